"""Loads off a CUDA stream copy layers in runs of growing length (``mover.layer_runs``):
layer 0 alone, then longer runs, each layer signalled once its run is copied; the bytes
are those of a load layer by layer, in every host layout."""

import pytest
import torch

from kvtier import DeviceKVPool, HierarchicalCache, HostKVPool, KVSpec
from kvtier.cache import mover
from tests.support.cache_engine import check_prefix, serve
from tests.support.pools import LAYOUT_ORDERS


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


@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
def test_a_load_copies_in_runs_and_each_layer_is_done_with_its_run(monkeypatch, layout):
    spec, page = KVSpec.mha(11, 2, 6, v_head_dim=4, dtype=torch.float64), 4
    cache = HierarchicalCache(DeviceKVPool(spec, 64, page), HostKVPool(spec, 64, page, layout=layout))
    tokens = list(range(100, 112))
    serve(cache, tokens)
    cache.evict_device(64)
    calls, real = [], cache.host_pool.load_to_device_layers

    def load(device_pool, host_indices, device_indices, layers, io_backend):
        calls.append(layers)
        real(device_pool, host_indices, device_indices, layers, io_backend)

    monkeypatch.setattr(cache.host_pool, "load_to_device_layers", load)
    m = cache.match_prefix(tokens)
    with cache.locked(m):
        handle = cache.load_back(m)
        assert handle.wait(timeout=10) and handle.error is None
        assert all(handle.wait_layer(layer, timeout=0) for layer in range(spec.layer_num))
        check_prefix(cache, tokens, handle.device_indices)
    assert calls == mover.layer_runs(spec.layer_num) == [range(0, 1), range(1, 5), range(5, 11)]
