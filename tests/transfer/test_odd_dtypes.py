"""1-byte and other dtypes without numpy or CPU index-op support (fp8, bfloat16) on every
io_backend: device -> host -> device round trips are bit-exact."""

import pytest
import torch

from kvtier import HostKVPool, KVSpec
from tests.support.pools import LAYOUT_ORDERS, bits, random_device_pool, slots

DTYPES = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "bfloat16") if hasattr(torch, n)]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("io_backend", ["direct", "kernel", "auto"])
@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip(dtype, layout, io_backend, page_size):
    spec = KVSpec.mha(2, 2, 12, v_head_dim=8, dtype=dtype)
    src = random_device_pool(spec, 8 * page_size, page_size, seed=1)
    dst = random_device_pool(spec, 8 * page_size, page_size, seed=2)
    host = HostKVPool(spec, 4 * page_size, page_size, layout=layout)
    host_slots, src_slots, dst_slots = slots([2, 0, 1], page_size), slots([5, 1, 2], page_size), \
        slots([0, 6, 7], page_size)
    host.backup_from_device_all_layer(src, host_slots, src_slots, io_backend=io_backend)
    for layer in range(spec.layer_num):
        host.load_to_device_per_layer(dst, host_slots, dst_slots, layer, io_backend=io_backend)
    for name in spec.names:
        for layer in range(spec.layer_num):
            assert torch.equal(bits(dst.buffer(name, layer)[dst_slots]), bits(src.buffer(name, layer)[src_slots]))
