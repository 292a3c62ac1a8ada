"""Model identity in storage keys: two checkpoints of one architecture sharing a store
never reuse each other's KV; the same checkpoint does."""

import warnings

import pytest
import torch

pytest.importorskip("transformers")

import kvtier.storage  # noqa: E402
from kvtier import DeviceKVPool, HierarchicalCache, HostKVPool, KVSpec  # noqa: E402
from kvtier.integrations.identity import model_namespace, weights_digest  # noqa: E402
from kvtier.integrations.transformers import CachedGenerator, generate_uncached, hf_namespace  # noqa: E402
from kvtier.tiny_models import build  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)


def test_fine_tunes_of_one_architecture_do_not_share_kv(tmp_path):
    store = kvtier.storage.open(f"file://{tmp_path}")
    base, tuned, again = (build("llama", layers=2, hidden=64, vocab=256, seed=s) for s in (1, 2, 1))
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    first = CachedGenerator.build(base, device_tokens=256, host_tokens=256, page_size=8, storage=store)
    first.generate(prompt, max_new_tokens=4)
    first.cache.flush()
    other = CachedGenerator.build(tuned, device_tokens=256, host_tokens=256, page_size=8, storage=store)
    got = other.generate(prompt, max_new_tokens=4)
    assert got.storage_tokens == 0
    assert got.output == generate_uncached(tuned, prompt, max_new_tokens=4)[0]
    same = CachedGenerator.build(again, device_tokens=256, host_tokens=256, page_size=8, storage=store)
    assert same.generate(prompt, max_new_tokens=4).storage_tokens == 64    # same weights: reused
    assert first.cache.namespace == same.cache.namespace != other.cache.namespace
    for g in (first, other, same):
        g.cache.close()


def test_namespace_names_checkpoint_dtype_and_weights():
    net = build("mimo", layers=2, hidden=64, vocab=256, seed=1)
    ns = hf_namespace(net)
    assert ns.startswith(f"hf:{type(net).__name__}@unversioned:float32:w")
    net.config._name_or_path, net.config._commit_hash = "org/mimo-tiny", "abc123"
    assert hf_namespace(net).startswith("hf:org/mimo-tiny@abc123:float32:w")
    with torch.no_grad():
        next(net.parameters()).view(-1)[0] += 1
    assert hf_namespace(net).split(":w")[1] != ns.split(":w")[1]
    assert weights_digest(net) == weights_digest(net)
    assert model_namespace("m", None, torch.bfloat16, None) == "m@unversioned:bfloat16"


def test_a_cache_with_storage_needs_a_namespace(tmp_path):
    spec = KVSpec.mha(1, 1, 4)
    store = kvtier.storage.open(f"file://{tmp_path}")
    with pytest.raises(ValueError, match="needs namespace="):
        HierarchicalCache(DeviceKVPool(spec, 16, 4), HostKVPool(spec, 16, 4), store)
    HierarchicalCache(DeviceKVPool(spec, 16, 4), HostKVPool(spec, 16, 4)).close()   # no storage: no keys


def _checkpoint(path, seed, layers=2):
    net = build("llama", layers=layers, hidden=64, vocab=256, seed=seed)
    net.save_pretrained(path)
    return path


def test_directory_digest_changes_with_the_weights_and_only_with_them(tmp_path):
    from kvtier.integrations.identity import checkpoint_digest, directory_digest

    model = _checkpoint(tmp_path / "m", seed=1)
    first = directory_digest(model)
    assert first == directory_digest(model)                 # unchanged files: the same name, restart after restart
    (model / "tokenizer.json").write_text("{}")             # not weights: no change
    (model / "README.md").write_text("notes")
    assert directory_digest(model) == first
    _checkpoint(tmp_path / "m", seed=2)                     # re-trained, saved to the same path
    second = directory_digest(model)
    assert second != first
    config = (model / "config.json").read_text()
    (model / "config.json").write_text(config.replace('"rope_theta"', '"rope_theta_x"'))
    assert directory_digest(model) != second                # the config shapes the KV too
    assert checkpoint_digest(str(model), "main") == ("main", directory_digest(model))
    assert checkpoint_digest(str(tmp_path / "absent"), None) == (None, None)
    (tmp_path / "empty").mkdir()
    assert directory_digest(tmp_path / "empty") is None


def test_safetensors_headers_name_the_tensors_without_reading_weights(tmp_path):
    from kvtier.integrations.identity import _safetensors_header, directory_digest

    model = _checkpoint(tmp_path / "m", seed=1)
    weights = model / "model.safetensors"
    header = _safetensors_header(weights, weights.stat().st_size)
    assert b"model.layers.0.self_attn.k_proj.weight" in header
    (model / "broken.safetensors").write_bytes(b"\xff" * 8 + b"junk")   # a header length past the file: ignored
    assert _safetensors_header(model / "broken.safetensors", 12) == b""
    assert directory_digest(model) is not None


def test_a_hub_id_names_its_cached_commit(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from kvtier.integrations.identity import checkpoint_digest, engine_namespace

    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "0123abcd"
    _checkpoint(snapshot, seed=1)
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    revision, digest = checkpoint_digest("org/tiny")
    assert revision == "0123abcd" and digest is not None
    assert engine_namespace("vllm", "org/tiny", None, "bfloat16").startswith("vllm:org/tiny@0123abcd:bfloat16:w")
    assert checkpoint_digest("org/not-cached") == (None, None)
