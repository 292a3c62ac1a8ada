"""Transfers between a CUDA device pool and a pinned host pool: every geometry, layout and io
backend (the Triton kernel for "kernel"). Skips where no CUDA device is present."""

import pytest
import torch

from kvtier import DeviceKVPool, HostKVPool
from tests.support.pools import LAYOUT_ORDERS, SPECS, bits, random_device_pool, slots

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("io_backend", ["direct", "kernel", "auto"])
@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_cuda_round_trip(spec_name, layout, io_backend, page_size):
    spec = SPECS[spec_name]
    cpu = random_device_pool(spec, 8 * page_size, page_size, seed=3)
    dev = DeviceKVPool(spec, 8 * page_size, page_size, device="cuda")
    for n in spec.names:
        for layer in range(spec.layer_num):
            dev.buffer(n, layer).copy_(cpu.buffer(n, layer))
    host = HostKVPool(spec, 6 * page_size, page_size, layout=layout)
    assert host.raw.is_pinned()
    hp, dp, lp = [4, 1, 2, 0], [7, 3, 4, 0], [5, 2, 6, 1]
    host.backup_from_device_all_layer(dev, slots(hp, page_size), slots(dp, page_size).cuda(), io_backend)
    out = DeviceKVPool(spec, 8 * page_size, page_size, device="cuda")
    for layer in range(spec.layer_num):
        host.load_to_device_per_layer(out, slots(hp, page_size), slots(lp, page_size).cuda(), layer, io_backend)
    torch.cuda.synchronize()
    for n in spec.names:
        for layer in range(spec.layer_num):
            got, src = bits(out.buffer(n, layer).cpu()), bits(cpu.buffer(n, layer))
            for d, h in zip(lp, dp):
                assert torch.equal(got[d * page_size:(d + 1) * page_size], src[h * page_size:(h + 1) * page_size])
