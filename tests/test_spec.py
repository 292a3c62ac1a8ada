import pytest
import torch

from kvtier import Component, KVSpec


def test_mha_defaults_v_dim_to_k_dim():
    spec = KVSpec.mha(32, 8, 128)
    assert spec.components == (Component("k", 8, 128), Component("v", 8, 128))
    assert spec.dtype == torch.bfloat16
    assert spec.bytes_per_token == 32 * (8 * 128 * 2) * 2


def test_asymmetric_mha_bytes():
    spec = KVSpec.mha(61, 8, 192, v_head_dim=128)
    assert spec.components[1] == Component("v", 8, 128)
    assert spec.bytes_per_token == 61 * 8 * (192 + 128) * 2
    assert spec.page_elems(64) == 64 * 61 * 8 * 320


def test_mla_is_one_head_of_rank_plus_rope():
    spec = KVSpec.mla(61, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.float16)
    assert spec.components == (Component("kv", 1, 576),)
    assert spec.bytes_per_token == 61 * 576 * 2


def test_k_only_and_free_form():
    assert KVSpec.k_only(4, 1, 128).names == ("k",)
    spec = KVSpec(2, [Component("k", 2, 8), Component("idx", 1, 4)], torch.float32)
    assert isinstance(spec.components, tuple)
    assert spec.bytes_per_token == 2 * (16 + 4) * 4
    assert spec.component("idx") == Component("idx", 1, 4)


def test_fingerprint_is_stable_and_distinguishes():
    a = KVSpec.mha(61, 8, 192, v_head_dim=128)
    assert a.fingerprint() == "L61-bf16-k=8x192-v=8x128"
    assert a.fingerprint() == KVSpec.mha(61, 8, 192, 128).fingerprint()
    others = [KVSpec.mha(61, 8, 192), KVSpec.mha(61, 8, 192, 128, dtype=torch.float16),
              KVSpec.mha(60, 8, 192, 128), KVSpec.mha(61, 4, 192, 128),
              KVSpec(61, (Component("key", 8, 192), Component("v", 8, 128)), torch.bfloat16)]
    assert len({a.fingerprint(), *(o.fingerprint() for o in others)}) == 6


def test_specs_are_hashable_values():
    assert KVSpec.mha(2, 1, 4) == KVSpec.mha(2, 1, 4)
    assert len({KVSpec.mha(2, 1, 4), KVSpec.mha(2, 1, 4)}) == 1


@pytest.mark.parametrize("make, field", [
    (lambda: Component("k", 0, 8), "head_num"),
    (lambda: Component("k", 2, -1), "head_dim"),
    (lambda: Component("k", 2.0, 8), "head_num"),
    (lambda: Component("", 2, 8), "name"),
    (lambda: Component("k v", 2, 8), "name"),
    (lambda: KVSpec(0, (Component("k", 1, 8),), torch.float32), "layer_num"),
    (lambda: KVSpec(2, (), torch.float32), "components"),
    (lambda: KVSpec(2, (Component("k", 1, 8), Component("k", 2, 8)), torch.float32), "duplicate"),
    (lambda: KVSpec(2, (Component("k", 1, 8),), "bf16"), "dtype"),
    (lambda: KVSpec(2, (Component("k", 1, 8),), torch.complex64), "dtype"),
    (lambda: KVSpec.mha(2, 8, 128, v_head_dim=0), "head_dim"),
    (lambda: KVSpec.mla(2, 0, 64), "kv_lora_rank"),
])
def test_invalid_numbers_name_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_shard_splits_multi_head_components_and_replicates_single_head():
    full = KVSpec(2, (Component("k", 8, 192), Component("v", 8, 128), Component("idx", 1, 64)), torch.bfloat16)
    s = full.shard(3, 4)
    assert s.components == (Component("k", 2, 192), Component("v", 2, 128), Component("idx", 1, 64))
    assert s.head_range("k") == (6, 8) and s.head_range("v") == (6, 8) and s.head_range("idx") == (0, 1)
    assert s.fingerprint() == full.fingerprint() and s.full is full
    assert s != full.shard(2, 4) and s == full.shard(3, 4)
    assert full.head_range("k") == (0, 8)
    assert KVSpec.mla(2, 16, 4).shard(1, 2).components == (Component("kv", 1, 20),)


@pytest.mark.parametrize("rank, size, match", [
    (0, 3, "8 heads, not divisible by shard size 3"),
    (4, 4, r"rank 4 is out of range \[0, 4\)"),
    (0, 0, "size must be a positive int"),
])
def test_bad_shards(rank, size, match):
    with pytest.raises(ValueError, match=match):
        KVSpec.mha(2, 8, 64).shard(rank, size)
    with pytest.raises(ValueError, match="already a shard"):
        KVSpec.mha(2, 8, 64).shard(0, 2).shard(0, 2)
