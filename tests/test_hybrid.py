"""Hybrid KV geometry: layer groups with their own geometry and attention kind, the
real models' numbers, fingerprints, shards, and errors that name the fault."""

import pytest
import torch

from kvtier import Attention, Component, HybridSpec, KVGroup, KVSpec
from kvtier.hybrid import PRESETS, gemma3_27b, gpt_oss, mimo_v2_flash


def test_mimo_v2_flash_in_numbers():
    mimo = mimo_v2_flash()
    full, swa = mimo.group("full"), mimo.group("swa")
    assert full.layers == (0, 5, 11, 17, 23, 29, 35, 41, 47) and len(swa.layers) == 39 and mimo.layer_num == 48
    assert [(c.name, c.head_num, c.head_dim) for c in swa.spec.components] == [("k", 8, 192), ("v", 8, 128)]
    assert mimo.bytes_per_token() == {"full": 23_040, "swa": 199_680}
    assert mimo.full_bytes_per_token == 23_040
    assert mimo.window_bytes == 128 * 199_680 == 25_559_040          # sliding KV per resume point
    assert mimo.uniform_bytes_per_token == 222_720                     # what a window-blind cache stores a token
    assert mimo.bytes_for(4096, resume_points=1) == 4096 * 23_040 + 128 * 199_680
    assert mimo.bytes_for(100) == 100 * 222_720                        # shorter than a window: every token
    assert mimo.group_of(5) == (full, 1) and mimo.group_of(6) == (swa, 4)
    with pytest.raises(ValueError, match=r"layer 48 is out of range \[0, 48\)"):
        mimo.group_of(48)


def test_presets_are_the_real_layer_patterns():
    oss = gpt_oss(36)
    assert oss.group("swa").layers == tuple(range(0, 36, 2)) and oss.group("full").layers == tuple(range(1, 36, 2))
    assert oss.group("swa").attention == Attention.sliding(128)
    assert oss.bytes_per_token() == {"full": 18 * 2 * 8 * 64 * 2, "swa": 18 * 2 * 8 * 64 * 2}
    gemma = gemma3_27b()
    assert gemma.group("full").layers == (5, 11, 17, 23, 29, 35, 41, 47, 53, 59) and gemma.layer_num == 62
    assert gemma.group("swa").attention.window == 1024
    assert set(PRESETS) == {"mimo-v2-flash", "gpt-oss-120b", "gpt-oss-20b", "gemma3-27b"}
    assert PRESETS["gpt-oss-20b"]().layer_num == 24


def test_a_plain_spec_is_the_one_group_case_with_its_own_fingerprint():
    spec = KVSpec.mha(4, 2, 64, 32)
    one = HybridSpec.of(spec)
    assert one.is_uniform and one.uniform_spec == spec and one.layer_num == 4
    assert one.fingerprint() == spec.fingerprint()  # keys of uniform models do not change
    assert one.bytes_per_token() == {"kv": spec.bytes_per_token}
    with pytest.raises(ValueError, match="not one full group"):
        mimo_v2_flash().uniform_spec


def test_fingerprints_name_every_group_and_tell_geometries_apart():
    fp = mimo_v2_flash().fingerprint()
    assert fp == ("full:full:0,5,11,17,23,29,35,41,47:L9-bf16-k=4x192-v=4x128+"
                  "swa:swa128:1-4,6-10,12-16,18-22,24-28,30-34,36-40,42-46:L39-bf16-k=8x192-v=8x128")
    other_window = HybridSpec(tuple(KVGroup(g.name, g.layers, g.spec, Attention.sliding(256) if not
                                            g.attention.is_full else g.attention) for g in mimo_v2_flash().groups))
    assert other_window.fingerprint() != fp and mimo_v2_flash().fingerprint() == fp
    assert mimo_v2_flash(torch.float16).fingerprint() != fp


def test_from_layers_groups_equal_layers():
    sliding, full = Attention.sliding(64), Attention()
    kinds = [sliding] * 5 + [full] + [sliding] * 5 + [full]
    comps = (Component("k", 2, 32), Component("v", 2, 32))
    spec = HybridSpec.from_layers(kinds, [comps] * 12)
    assert spec.names == ("swa", "full")
    assert spec.group("full").layers == (5, 11) and spec.group("swa").spec.layer_num == 10
    wide = (Component("k", 4, 32), Component("v", 4, 32))
    mixed = HybridSpec.from_layers([full, sliding, sliding], [comps, wide, comps])
    assert mixed.names == ("full", "swa", "swa2") and mixed.group("swa2").layers == (2,)


def test_shards_split_every_groups_heads():
    mimo = mimo_v2_flash()
    half = mimo.shard(1, 2)
    assert half.group("full").spec.component("k").head_num == 2 and half.group("swa").spec.component("v").head_num == 4
    assert half.group("swa").spec.head_range("k") == (4, 8)
    assert half.fingerprint() == mimo.fingerprint() and half.full == mimo
    assert half.layer_num == 48
    with pytest.raises(ValueError, match="has 4 heads, not divisible by shard size 8"):
        mimo.shard(0, 8)


@pytest.mark.parametrize("make, message", [
    (lambda: Attention("recurrent"), "Attention.kind must be one of"),
    (lambda: Attention.sliding(0), "Attention.window must be a positive int"),
    (lambda: Attention("full", 4), "full attention has no window"),
    (lambda: KVGroup("g", (0, 2, 1), KVSpec.mha(3, 1, 8)), "must ascend without repeats"),
    (lambda: KVGroup("g", (0, 1), KVSpec.mha(3, 1, 8)), "2 layer ids for a spec of 3 layers"),
    (lambda: KVGroup("9g", (0,), KVSpec.mha(1, 1, 8)), "identifier"),
    (lambda: HybridSpec((KVGroup("a", (0, 1), KVSpec.mha(2, 1, 8)), KVGroup("b", (1, 2), KVSpec.mha(2, 1, 8)))),
     "layer 1 is in groups 'a' and 'b'"),
    (lambda: HybridSpec((KVGroup("a", (0, 2), KVSpec.mha(2, 1, 8)),)), r"layers \[1\] are in no group"),
    (lambda: HybridSpec((KVGroup("a", (0,), KVSpec.mha(1, 1, 8)), KVGroup("a", (1,), KVSpec.mha(1, 1, 8)))),
     r"HybridSpec.groups has duplicate names \[.a.\]"),
    (lambda: HybridSpec(()), "non-empty tuple"),
])
def test_bad_geometry_says_what_is_wrong(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_needed_tokens_of_a_resume_point():
    assert Attention().needed_tokens(300) == range(0, 300)
    assert Attention.sliding(128).needed_tokens(300) == range(172, 300)
    assert Attention.sliding(128).needed_tokens(50) == range(0, 50)


@pytest.mark.parametrize("window,page_size", [(3, 4), (6, 4), (8, 4), (20, 4), (1, 1), (5, 1), (129, 64)])
def test_reusable_pages_is_the_rule_token_by_token(window, page_size):
    """Against the rule written out per token: a resume after ``p`` pages needs every
    token before it from the full group and the last ``window`` tokens from the
    sliding group, each in a page that is held."""
    import random

    spec = HybridSpec((KVGroup("full", (0,), KVSpec.mha(1, 1, 8)),
                       KVGroup("swa", (1,), KVSpec.mha(1, 2, 8), Attention.sliding(window))))
    rng = random.Random(window * 100 + page_size)
    for _ in range(300):
        n = rng.randint(0, 12)
        present = {"full": [rng.random() < 0.9 for _ in range(n)], "swa": [rng.random() < 0.6 for _ in range(n)]}

        def ok(p):
            tokens_full = range(p * page_size)
            tokens_swa = range(max(0, p * page_size - window), p * page_size)
            return all(present["full"][t // page_size] for t in tokens_full) and \
                all(present["swa"][t // page_size] for t in tokens_swa)

        want = max(p for p in range(n + 1) if ok(p))
        assert spec.reusable_pages(page_size, present) == want, (present, window, page_size)
    with pytest.raises(ValueError, match=r"present must name exactly the groups \['full', 'swa'\]"):
        spec.reusable_pages(page_size, {"full": []})


def test_needed_pages_cover_the_window_in_whole_pages():
    a = Attention.sliding(6)
    assert list(a.needed_pages(16, 4)) == [2, 3] and list(a.needed_pages(4, 4)) == [0]
    assert list(a.needed_pages(0, 4)) == [] and list(Attention().needed_pages(9, 4)) == [0, 1, 2]
