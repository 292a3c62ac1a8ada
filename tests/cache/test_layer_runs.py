"""Loads off a CUDA stream copy layers in runs of growing length (``mover.layer_runs``):
layer 0 alone, then longer runs, each layer signalled once its run is copied; the bytes
are those of a load layer by layer, in every host layout."""

import contextlib

import pytest
import torch

from kvtier import DeviceKVPool, HierarchicalCache, HostKVPool, HybridHostPool, KVSpec
from kvtier.cache import mover
from kvtier.cache.handles import LoadHandle
from tests.support.cache_engine import check_prefix, serve
from tests.support.cache_hybrid_engine import HybridEngine, make_cache
from tests.support.pools import HYBRID_SPECS, LAYOUT_ORDERS


@pytest.mark.parametrize("layers, want", [
    (1, [(0, 1)]),
    (2, [(0, 1), (1, 2)]),
    (5, [(0, 1), (1, 5)]),
    (32, [(0, 1), (1, 5), (5, 21), (21, 32)]),
    (48, [(0, 1), (1, 5), (5, 21), (21, 37), (37, 48)]),
])
def test_runs_grow_then_repeat_the_last_length_and_cover_every_layer_once(layers, want):
    runs = mover.layer_runs(layers)
    assert [(r.start, r.stop) for r in runs] == want
    assert [layer for r in runs for layer in r] == list(range(layers))


SPEC, PAGE, TOKENS = KVSpec.mha(11, 2, 6, v_head_dim=4, dtype=torch.float64), 4, list(range(100, 112))


def host_only_prompt(monkeypatch, layout: str = "page_first", **kw) -> tuple[HierarchicalCache, list]:
    """A cache (``kw``: its options) holding ``TOKENS`` on the host only, and the list
    each host -> device copy appends its layers to."""
    cache = HierarchicalCache(DeviceKVPool(SPEC, 64, PAGE), HostKVPool(SPEC, 64, PAGE, layout=layout), **kw)
    serve(cache, TOKENS)
    cache.evict_device(64)
    calls, real = [], cache.host_pool.load_to_device_layers

    def load(device_pool, host_indices, device_indices, layers, io_backend):
        calls.append(layers)
        real(device_pool, host_indices, device_indices, layers, io_backend)

    monkeypatch.setattr(cache.host_pool, "load_to_device_layers", load)
    return cache, calls


@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
def test_a_load_copies_in_runs_and_each_layer_is_done_with_its_run(monkeypatch, layout):
    cache, calls = host_only_prompt(monkeypatch, layout=layout)
    m = cache.match_prefix(TOKENS)
    with cache.locked(m):
        handle = cache.load_back(m)
        assert handle.wait(timeout=10) and handle.error is None
        assert all(handle.wait_layer(layer, timeout=0) for layer in range(SPEC.layer_num))
        check_prefix(cache, TOKENS, handle.device_indices)
    assert calls == mover.layer_runs(SPEC.layer_num) == [range(0, 1), range(1, 5), range(5, 11)]


def test_a_synchronous_cache_loads_every_layer_in_one_copy(monkeypatch):
    # its jobs run on the caller's thread: nothing waits on a layer before the load ends
    cache, calls = host_only_prompt(monkeypatch, synchronous=True)
    got = cache.acquire(TOKENS)
    assert got.host_hit == 12 and got.load.error is None
    assert all(got.load.wait_layer(layer, timeout=0) for layer in range(SPEC.layer_num))
    check_prefix(cache, TOKENS, got.device_indices)
    assert calls == [range(0, 11)]
    cache.release(got)


@pytest.mark.parametrize("weights, want", [
    ([7] * 6, [(0, 1), (1, 5), (5, 6)]),  # equal layers: as counted
    ([0] * 6, [(0, 1), (1, 5), (5, 6)]),  # nothing to move: as counted
    ([100, 1, 1, 1, 1, 100], [(0, 1), (1, 6)]),  # a window's few pages ride with the next full layer
    ([1, 100, 1, 1, 1, 1], [(0, 2), (2, 6)]),  # the first run: about one heavy layer's bytes too
    ([100] + [1, 100] * 6, [(0, 1), (1, 9), (9, 13)]),  # 4 heavy layers a run, then the rest
])
def test_weighed_runs_hold_as_many_bytes_as_runs_of_the_heaviest_layer(weights, want):
    runs = mover.layer_runs(len(weights), weights=weights)
    assert [(r.start, r.stop) for r in runs] == want
    assert [layer for r in runs for layer in r] == list(range(len(weights)))


def test_weights_must_name_every_layer():
    with pytest.raises(ValueError, match="5 weights for 6 layers"):
        mover.layer_runs(6, weights=[1] * 5)


def _evicted_toy_mimo(monkeypatch, layout="layer_first"):
    """The toy MiMo's cache holding 64 tokens on the host only, and its load's calls:
    ``(spec, cache, engine, tokens, calls, weights)``, each call's layers and the bytes
    ``layer_bytes`` gives its indices."""
    spec = HYBRID_SPECS["mimo"]
    sizes = {g.name: 256 for g in spec.groups}
    cache = make_cache(spec, 4, sizes, sizes, layout=layout)
    eng, tokens = HybridEngine(cache), [(7 * i) % 1000 for i in range(64)]
    eng.serve(tokens)
    cache.flush()
    cache.evict_device(10 ** 9)
    calls, weights, real = [], [], HybridHostPool.load_to_device_layers

    def load(self, device_pool, host_indices, device_indices, layers, io_backend="direct"):
        calls.append(layers)
        weights.append(self.layer_bytes(host_indices))
        real(self, device_pool, host_indices, device_indices, layers, io_backend)

    monkeypatch.setattr(HybridHostPool, "load_to_device_layers", load)
    return spec, cache, eng, tokens, calls, weights


@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
def test_a_hybrid_load_runs_by_bytes_and_each_layer_is_done_with_its_run(monkeypatch, layout):
    """The toy MiMo (full layers 0 and 5, sliding 1-4 with a 6-token window): a load of 16
    pages moves each full layer's 16 and each sliding layer's 2, so its runs are layer 0,
    then the rest (as many bytes as 4 full layers, at most), not layers 1-4 and then 5."""
    spec, cache, eng, tokens, calls, weights = _evicted_toy_mimo(monkeypatch, layout)
    got = cache.acquire(tokens)
    assert got.device_indices.numel() == 64 and got.host_hit == 64
    eng.check_prefix(tokens, got.device_indices, got.groups, "load in runs")
    full, swa = (spec.groups[0], spec.groups[1]) if spec.groups[0].attention.is_full else spec.groups[::-1]
    per_token = {g.name: g.spec.bytes_per_token // g.spec.layer_num for g in (full, swa)}
    assert weights[0] == [64 * per_token[full.name]] + [8 * per_token[swa.name]] * 4 + [64 * per_token[full.name]]
    assert calls == mover.layer_runs(spec.layer_num, weights=weights[0]) == [range(0, 1), range(1, 6)]
    cache.release(got)
    cache.close()


def test_a_hybrid_load_off_a_cuda_stream_still_copies_a_layer_a_call(monkeypatch):
    """Runs weighed by bytes are for copies that block; on a CUDA stream each layer has a
    call and an event of its own, sliding or full (the stream stood in for here)."""
    spec, cache, eng, tokens, calls, _ = _evicted_toy_mimo(monkeypatch)
    events = []
    monkeypatch.setattr(mover.Mover, "_stream", lambda self, kind: (contextlib.nullcontext(), object()))
    monkeypatch.setattr(LoadHandle, "_record_cuda_event", lambda self, layer, stream: events.append(layer))
    got = cache.acquire(tokens)
    assert got.device_indices.numel() == 64
    eng.check_prefix(tokens, got.device_indices, got.groups, "load a layer a call")
    assert calls == [range(layer, layer + 1) for layer in range(spec.layer_num)]
    assert events == list(range(spec.layer_num))
    cache.release(got)
    cache.close()
