"""KVTierStorage under sglang's own HiCacheController and host pools, on the CPU.

Every backend here is created by the controller's ``attach_storage_backend`` (through
``StorageBackendFactory``'s ``dynamic`` path) and driven by its storage methods.
"""

import hashlib
import json
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import AsymmetricMHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa: E402

from kvtier.integrations.sglang import KVTierStorage  # noqa: E402
from kvtier.integrations.sglang.pools import UnsupportedPoolError  # noqa: E402
from tests.support.sglang_rig import (PAGE_SIZE, POOLS, STORAGE_BATCH_SIZE, attach, backup, fill_random,  # noqa: E402
                                      kvtier_config, make_pools, mha_pools, page_keys, prefetch, same_tokens)

PAGES = STORAGE_BATCH_SIZE + 22  # two controller batches: 128 pages, then 22


def tokens_for(pages: int, start: int = 1000) -> list[int]:
    return list(range(start, start + pages * PAGE_SIZE))


def written(kind, layout, url, pages=PAGES, seed=1, **attach_kw):
    """A filled pool whose first ``pages`` pages the controller backed up."""
    device, host = make_pools(kind, layout)
    fill_random(host, seed)
    controller = attach(device, host, extra_config=kvtier_config(url), **attach_kw)
    slots = host.alloc(pages * PAGE_SIZE)
    assert backup(controller, slots, tokens_for(pages)) == pages * PAGE_SIZE
    return controller, host, slots


@pytest.mark.parametrize("kind, layout", POOLS)
def test_pages_round_trip_through_the_controller(kind, layout, tmp_path):
    controller, host, src = written(kind, layout, f"file://{tmp_path}")
    if kind == "asym":
        assert isinstance(host, AsymmetricMHATokenToKVPoolHost)
    assert isinstance(controller.storage_backend, KVTierStorage)
    assert controller.page_get_func.__name__ == "_page_get_zero_copy"
    hit, pages, dst = prefetch(controller, host, tokens_for(PAGES))
    assert (hit, pages) == (PAGES * PAGE_SIZE, PAGES)
    assert same_tokens(host, src, host, dst)
    # a prompt that shares only the first 10 pages hits exactly those
    assert prefetch(controller, host, tokens_for(10) + [7] * 3 * PAGE_SIZE)[:2] == (10 * PAGE_SIZE, 10)
    controller.detach_storage_backend()


@pytest.mark.parametrize("kind, writer, reader", [
    ("asym", "page_first", "page_first_direct"), ("asym", "page_first_direct", "page_first"),
    ("mha", "layer_first", "page_head"), ("mha", "page_head", "page_first"),
    ("mla", "page_first", "page_unified"), ("mla", "page_unified", "layer_first"),
])
def test_pages_move_between_host_layouts(kind, writer, reader, tmp_path):
    _, source, src = written(kind, writer, f"file://{tmp_path}")
    device, host = make_pools(kind, reader)
    controller = attach(device, host, extra_config=kvtier_config(f"file://{tmp_path}"))
    hit, pages, dst = prefetch(controller, host, tokens_for(PAGES))
    assert (hit, pages) == (PAGES * PAGE_SIZE, PAGES)
    assert same_tokens(source, src, host, dst)


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate"])
def test_a_corrupt_object_is_a_counted_miss_and_is_removed(damage, tmp_path):
    controller, host, src = written("asym", "page_first", f"file://{tmp_path}", pages=3)
    backend = controller.storage_backend
    (key,) = backend.binding("kv").keys(page_keys(tokens_for(3))[1:2])
    h = hashlib.sha256(key.encode()).hexdigest()  # file:// layout: <dir>/kvtier-v5/<h[:2]>/<h[2:]>.<field>
    victim = sorted((tmp_path / "kvtier-v5" / h[:2]).glob(f"{h[2:]}.*"))[0]
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        del data[len(data) // 2:]
    else:
        data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    hit, pages, dst = prefetch(controller, host, tokens_for(3))
    assert (hit, pages) == (3 * PAGE_SIZE, 1)  # present, but page 1 does not load: the load stops there
    assert same_tokens(host, src[:PAGE_SIZE], host, dst[:PAGE_SIZE])
    stats = backend.stats()
    assert stats["errors"] >= 1 and stats["misses"] >= 1
    assert prefetch(controller, host, tokens_for(3))[:2] == (PAGE_SIZE, 1)  # the corrupt object is gone


def test_sglang_file_backend_raises_on_the_asymmetric_pool_where_kvtier_works(tmp_path, monkeypatch):
    """Why this integration exists: sglang's generic storage path needs the pool's
    flat-page methods, which the asymmetric K/V pool does not implement."""
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "sglang"))
    device, host = make_pools("asym", "page_first")
    fill_random(host, 3)
    slots = host.alloc(2 * PAGE_SIZE)
    sglang_file = attach(device, host, backend="file")
    with pytest.raises(NotImplementedError, match="head_dim != v_head_dim"):
        backup(sglang_file, slots, tokens_for(2))
    sglang_file.detach_storage_backend()
    kvtier = attach(device, host, extra_config=kvtier_config(f"file://{tmp_path / 'kvtier'}"))
    assert backup(kvtier, slots, tokens_for(2)) == 2 * PAGE_SIZE
    hit, pages, dst = prefetch(kvtier, host, tokens_for(2))
    assert pages == 2 and same_tokens(host, slots, host, dst)


@pytest.mark.parametrize("kind, layout", [("mha", "page_first"), ("mha", "layer_first"), ("mla", "page_unified")])
def test_generic_flat_page_path_without_interface_v1_stores_the_same_objects(kind, layout, tmp_path):
    url = f"file://{tmp_path}"
    device, host = make_pools(kind, layout)
    fill_random(host, 4)
    config = {k: v for k, v in kvtier_config(url).items() if k != "interface_v1"}
    generic = attach(device, host, extra_config=config)
    assert generic.page_set_func.__name__ == "_generic_page_set"
    src = host.alloc(5 * PAGE_SIZE)
    if layout == "page_unified":  # sglang's own get_data_page has no branch for this layout
        with pytest.raises(ValueError, match="Unsupported layout"):
            backup(generic, src, tokens_for(5))
        return
    assert backup(generic, src, tokens_for(5)) == 5 * PAGE_SIZE
    hit, pages, dst = prefetch(generic, host, tokens_for(5))
    assert pages == 5 and same_tokens(host, src, host, dst)
    # a zero-copy reader with another layout finds the same canonical objects
    device2, other = make_pools(kind, "page_head" if kind == "mha" else "page_first_direct")
    zero_copy = attach(device2, other, extra_config=kvtier_config(url))
    hit, pages, dst = prefetch(zero_copy, other, tokens_for(5))
    assert pages == 5 and same_tokens(host, src, other, dst)


def test_asymmetric_pool_without_interface_v1_fails_at_attach(tmp_path):
    device, host = make_pools("asym", "page_first")
    config = {k: v for k, v in kvtier_config(f"file://{tmp_path}").items() if k != "interface_v1"}
    with pytest.raises(UnsupportedPoolError, match="interface_v1"):
        attach(device, host, extra_config=config)


def test_namespace_defaults_to_the_model_and_can_be_shared_explicitly(tmp_path):
    url = f"file://{tmp_path}"
    _, source, src = written("mha", "page_first", url, pages=4, model_name="model-a")
    device, host = make_pools("mha", "page_first")
    assert prefetch(attach(device, host, extra_config=kvtier_config(url), model_name="model-b"), host,
                    tokens_for(4))[:2] == (0, 0)
    for model in ("model-a", "model-b"):  # an explicit namespace names pages whatever sglang's model name
        device, host = make_pools("mha", "page_first")
        fill_random(host, 9)
        controller = attach(device, host, extra_config=kvtier_config(url, namespace="shared"), model_name=model)
        slots = host.alloc(4 * PAGE_SIZE)
        if model == "model-a":
            backup(controller, slots, tokens_for(4))
            first, first_slots = host, slots
        else:
            hit, pages, dst = prefetch(controller, host, tokens_for(4))
            assert pages == 4 and same_tokens(first, first_slots, host, dst)


def _checkpoint(path, seed):
    """A checkpoint directory as sglang loads one: a config and safetensors weights."""
    from safetensors.torch import save_file

    path.mkdir(exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.randn(8, 8, generator=torch.Generator().manual_seed(seed))}, str(path / "model.safetensors"))
    return str(path)


def test_a_checkpoint_overwritten_in_place_never_reads_the_old_weights_pages(tmp_path):
    url = f"file://{tmp_path}/store"
    model = _checkpoint(tmp_path / "model", seed=1)
    written("mha", "page_first", url, pages=4, model_name=model)
    _checkpoint(tmp_path / "model", seed=2)  # re-trained, saved to the same path
    device, host = make_pools("mha", "page_first")
    assert prefetch(attach(device, host, extra_config=kvtier_config(url), model_name=model), host,
                    tokens_for(4))[:2] == (0, 0)
    _, first, first_slots = written("mha", "page_first", url, pages=4, seed=5, model_name=model)
    device, host = make_pools("mha", "page_first")  # unchanged weights, a new server: their own pages
    hit, pages, dst = prefetch(attach(device, host, extra_config=kvtier_config(url), model_name=model), host,
                               tokens_for(4))
    assert pages == 4 and same_tokens(first, first_slots, host, dst)


def test_pipeline_stages_keep_their_layers_apart(tmp_path):
    """Two stages of equal depth have one geometry; the layer range keeps their pages apart."""
    url = f"file://{tmp_path}"
    stages = []
    for stage in range(2):
        device, host = mha_pools("page_first", start_layer=3 * stage)
        fill_random(host, 30 + stage)
        controller = attach(device, host, extra_config=kvtier_config(url), pp_rank=stage, pp_size=2)
        src = host.alloc(2 * PAGE_SIZE)
        assert backup(controller, src, tokens_for(2)) == 2 * PAGE_SIZE
        stages.append((host, src))
    device, host = mha_pools("page_first_direct", start_layer=0)  # stage 0 again, after stage 1 wrote
    reader = attach(device, host, extra_config=kvtier_config(url), pp_rank=0, pp_size=2)
    hit, pages, dst = prefetch(reader, host, tokens_for(2))
    assert pages == 2 and same_tokens(stages[0][0], stages[0][1], host, dst)



def test_context_parallel_ranks_keep_their_slices_apart(tmp_path, monkeypatch):
    """Under NSA context parallel each attention CP rank holds its own slice of every page
    (sglang's own file backend keys each rank apart): rank 1 finds none of rank 0's
    pages, and rank 0 reads its own back (before, every rank wrote the same keys)."""
    from sglang.srt.managers.cache_controller import HiCacheController

    url = f"file://{tmp_path}"
    monkeypatch.setattr(HiCacheController, "get_attn_cp_rank_and_size", lambda self: (0, 2))
    controller, first, first_slots = written("mha", "page_first", url, pages=2, seed=8)
    monkeypatch.setattr(HiCacheController, "get_attn_cp_rank_and_size", lambda self: (1, 2))
    device, host = make_pools("mha", "page_first")
    assert prefetch(attach(device, host, extra_config=kvtier_config(url)), host, tokens_for(2))[:2] == (0, 0)
    monkeypatch.setattr(HiCacheController, "get_attn_cp_rank_and_size", lambda self: (0, 2))
    device, host = make_pools("mha", "page_first")
    hit, pages, dst = prefetch(attach(device, host, extra_config=kvtier_config(url)), host, tokens_for(2))
    assert pages == 2 and same_tokens(first, first_slots, host, dst)

def test_stats_are_sglang_storage_metrics_with_kvtier_counters(tmp_path):
    controller, host, _ = written("asym", "page_first_direct", f"file://{tmp_path}", pages=6)
    prefetch(controller, host, tokens_for(6))
    metrics = controller.storage_backend.get_stats()
    assert isinstance(metrics, StorageMetrics)
    assert (metrics.backup_pgs, metrics.prefetch_pgs) == ([6], [6])
    assert metrics.kvtier["hits"] == 6 and metrics.kvtier["errors"] == 0
    assert controller.storage_backend.get_stats().backup_pgs == []  # per interval, as sglang's collector wants
    controller.storage_backend.clear()
    assert prefetch(controller, host, tokens_for(6))[:2] == (0, 0)


def test_a_storage_server_that_is_down_gives_misses_and_counted_errors():
    device, host = make_pools("asym", "page_first")
    controller = attach(device, host, extra_config=kvtier_config("redis://127.0.0.1:1/0?socket_timeout=0.2"))
    slots = host.alloc(2 * PAGE_SIZE)
    assert backup(controller, slots, tokens_for(2)) == 0
    assert prefetch(controller, host, tokens_for(2))[:2] == (0, 0)
    assert controller.storage_backend.stats()["errors"] >= 2


def test_extra_config_from_a_json_file(tmp_path):
    path = tmp_path / "kvtier.json"
    path.write_text(json.dumps({**kvtier_config(f"file://{tmp_path / 'store'}"), "prefetch_threshold": 64}))
    config, threshold, *_ = HybridCacheController.parse_storage_backend_extra_config(f"@{path}")
    assert threshold == 64
    device, host = make_pools("asym", "page_first")
    fill_random(host, 6)
    controller = attach(device, host, extra_config=config)
    slots = host.alloc(PAGE_SIZE)
    assert backup(controller, slots, tokens_for(1)) == PAGE_SIZE


def storage_config(extra: dict, model_name: str | None = "m") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name=model_name, extra_config=extra)


@pytest.mark.parametrize("extra, model_name, message", [
    ({"url": "file:///tmp/x", "capacity": 5}, "m", r"unknown keys \['capacity'\]"),
    ({}, "m", "needs \"url\""),
    ({"url": "s3://bucket"}, "m", "unknown storage scheme 's3'"),
    ({"url": "file:///tmp/x?bogus=1"}, "m", "unknown URL option 'bogus'"),
    ({"url": "redis://127.0.0.1:6379/0?ttl=soon"}, "m", "ttl"),
    ({"url": "file:///tmp/x", "namespace": ""}, "m", "namespace"),
    ({"url": "file:///tmp/x"}, None, "no model_name"),
])
def test_bad_extra_config_fails_at_construction(extra, model_name, message, tmp_path):
    _, host = mha_pools("page_first")
    extra = {**kvtier_config(""), **extra} if "url" in extra else \
        {k: v for k, v in kvtier_config("").items() if k != "url"}
    with pytest.raises(ValueError, match=message):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra, model_name), host)


def test_unsupported_host_layout_fails_at_attach_naming_the_ones_that_work(tmp_path):
    device, host = mha_pools("page_unified", head_num=2, head_dim=16, v_head_dim=16)
    with pytest.raises(UnsupportedPoolError, match="use --hicache-mem-layout layer_first or page_first"):
        attach(device, host, extra_config=kvtier_config(f"file://{tmp_path}"))


def test_pages_are_read_in_place_without_the_pools_page_methods(tmp_path, monkeypatch):
    device, host = make_pools("mha", "page_head")
    for name in ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page", "get_page_buffer_meta",
                 "get_split_heads_page_buffer_meta", "get_page_buffer_element_size"):
        monkeypatch.setattr(host, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} was called"), raising=False)
    fill_random(host, 8)
    controller = attach(device, host, extra_config=kvtier_config(f"file://{tmp_path}"))
    src = host.alloc(3 * PAGE_SIZE)
    assert backup(controller, src, tokens_for(3)) == 3 * PAGE_SIZE
    hit, pages, dst = prefetch(controller, host, tokens_for(3))
    assert pages == 3 and same_tokens(host, src, host, dst)


def test_kvtier_imports_without_sglang_and_the_class_loads_lazily():
    import subprocess
    import sys

    code = ("import sys; sys.modules['sglang'] = None; import kvtier, kvtier.integrations.sglang as s\n"
            "try:\n    s.KVTierStorage\nexcept ImportError:\n    print('lazy')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent)
    assert out.stdout.strip() == "lazy"
    assert torch.__version__.startswith("2.13.0")


def test_what_sglang_file_backend_does_with_the_same_pools(tmp_path, monkeypatch):
    """The comparison the README states: sglang's own file backend on symmetric MHA pools
    round-trips within one layout and TP size, misses at another TP size, and loads
    another layout's pages as they are (its keys name neither layout nor dtype)."""
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    device, writer = make_pools("mha", "page_first")
    fill_random(writer, 12)
    src = writer.alloc(3 * PAGE_SIZE)
    assert backup(attach(device, writer, backend="file"), src, tokens_for(3)) == 3 * PAGE_SIZE
    hit, pages, dst = prefetch(attach(device, writer, backend="file"), writer, tokens_for(3))
    assert pages == 3 and same_tokens(writer, src, writer, dst)
    device, half = make_pools("mha", "page_first", tp_size=2)
    assert prefetch(attach(device, half, backend="file", tp_rank=0, tp_size=2), half, tokens_for(3))[:2] == (0, 0)
    device, other = make_pools("mha", "layer_first")
    hit, pages, dst = prefetch(attach(device, other, backend="file"), other, tokens_for(3))
    assert pages == 3 and not same_tokens(writer, src, other, dst)  # loaded, but permuted
