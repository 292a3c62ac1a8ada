"""Every misuse raises ValueError (or a named error) with its numbers, and moves no byte."""

import pytest
import torch

from kvtier import DeviceKVPool, HostKVPool, KVSpec
from tests.support.pools import SPECS, bits, random_device_pool, slots

SPEC = SPECS["asym"]


@pytest.fixture
def pools():
    dev = random_device_pool(SPEC, 32, 4, seed=1)
    host = HostKVPool(SPEC, 16, 4, layout="page_head")
    host.backup_from_device_all_layer(random_device_pool(SPEC, 32, 4, seed=2), slots([0, 1, 2, 3], 4),
                                      slots([0, 1, 2, 3], 4))
    return dev, host


def snapshot(dev, host):
    return ([bits(dev.buffer(n, l)).clone() for n in SPEC.names for l in range(SPEC.layer_num)],
            [bits(b).clone() for b in host.buffers.values()])


def unchanged(a, b):
    return all(torch.equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def call(op, dev, host, hi, di, **kw):
    if op == "backup":
        host.backup_from_device_all_layer(dev, hi, di, **kw)
    else:
        host.load_to_device_per_layer(dev, hi, di, kw.pop("layer_id", 0), **kw)


@pytest.mark.parametrize("op", ["backup", "load"])
@pytest.mark.parametrize("hi, di, kw, match", [
    (slots([0, 1], 4), slots([0], 4), {}, "host_indices has 8 slots, device_indices 4"),
    (slots([4], 4), slots([0], 4), {}, r"host_indices has slots in \[16, 19\], outside the pool's \[0, 16\)"),
    (slots([0], 4), slots([8], 4), {}, r"device_indices has slots in \[32, 35\], outside the pool's \[0, 32\)"),
    (slots([0], 4)[:3], slots([0], 4)[:3], {}, "3 slots, not a multiple of page_size 4"),
    (slots([0], 4) + 1, slots([0], 4), {}, "starts at slot 1"),
    (slots([0], 4), torch.tensor([0, 2, 1, 3]), {}, r"slots \[0, 2, 1, 3\] are not consecutive"),
    (slots([0], 4).float(), slots([0], 4), {}, "dtype int64 or int32"),
    (slots([0], 4), slots([0], 4), {"io_backend": "cuda_magic"}, "unknown io_backend 'cuda_magic'.*direct, kernel"),
])
def test_bad_transfer_raises_before_any_byte(pools, op, hi, di, kw, match):
    dev, host = pools
    before = snapshot(dev, host)
    with pytest.raises(ValueError, match=match):
        call(op, dev, host, hi, di, **kw)
    assert unchanged(before, snapshot(dev, host))


@pytest.mark.parametrize("layer_id", [-1, 3, 1.0, True])
def test_layer_id_out_of_range(pools, layer_id):
    dev, host = pools
    before = snapshot(dev, host)
    with pytest.raises(ValueError, match=r"layer_id .* out of range \[0, 3\)"):
        host.load_to_device_per_layer(dev, slots([0], 4), slots([0], 4), layer_id)
    assert unchanged(before, snapshot(dev, host))


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
def test_duplicate_destination_pages_are_rejected(pools, io_backend):
    dev, host = pools
    with pytest.raises(ValueError, match="host_indices names the same page more than once"):
        host.backup_from_device_all_layer(dev, slots([1, 1], 4), slots([0, 2], 4))
    with pytest.raises(ValueError, match="device_indices names the same page more than once"):
        host.load_to_device_per_layer(dev, slots([0, 2], 4), slots([3, 3], 4), 0)
    # reading one source page into two destinations is fine
    host.load_to_device_per_layer(dev, slots([1, 1], 4), slots([5, 6], 4), 0, io_backend=io_backend)
    assert torch.equal(bits(dev.buffer("v", 0))[20:24], bits(dev.buffer("v", 0))[24:28])


def test_mismatched_pools(pools):
    dev, host = pools
    other = DeviceKVPool(KVSpec.mha(3, 4, 12), 32, 4)
    with pytest.raises(ValueError, match="L3-bf16-k=4x12-v=4x12 differs from host pool spec L3-bf16-k=4x12-v=4x8"):
        host.backup_from_device_all_layer(other, slots([0], 4), slots([0], 4))
    with pytest.raises(ValueError, match="page_size 8 != host pool page_size 4"):
        host.backup_from_device_all_layer(DeviceKVPool(SPEC, 32, 8), slots([0], 4), slots([0], 4))
    with pytest.raises(ValueError, match="DeviceKVPool"):
        host.backup_from_device_all_layer({"k": []}, slots([0], 4), slots([0], 4))


def test_flat_page_errors(pools):
    _, host = pools
    page = host.get_data_page(4)
    with pytest.raises(ValueError, match="page index 5 must be a multiple of page_size 4"):
        host.get_data_page(5)
    with pytest.raises(ValueError, match=r"in \[0, 16\)"):
        host.get_data_page(16)
    with pytest.raises(ValueError, match=f"has {page.numel() - 1} elements, a flat page has {page.numel()}"):
        host.set_from_flat_data_page(8, page[1:])
    with pytest.raises(ValueError, match="dtype torch.float32"):
        host.set_from_flat_data_page(8, page.float())
    with pytest.raises(ValueError, match="a meta tensor"):
        host.set_from_flat_data_page(8, torch.empty_like(page, device="meta"))
    assert torch.equal(bits(host.get_data_page(4)), bits(page))


def test_a_flat_page_that_requires_grad_is_written_as_bytes():
    """A page written from a tensor that requires grad: its bytes land, and the pool's
    buffers stay out of the caller's autograd graph (before, they came to require grad)."""
    spec = KVSpec.mha(2, 2, 4, dtype=torch.float32)
    host = HostKVPool(spec, 16, 4)
    page = torch.randn(spec.page_elems(4), requires_grad=True)
    host.set_from_flat_data_page(4, page)
    assert not any(b.requires_grad for b in host.buffers.values())
    assert torch.equal(host.get_data_page(4), page.detach())


@pytest.mark.parametrize("kwargs, match", [
    ({"size": 10, "page_size": 4}, "size 10 is not a multiple of page_size 4"),
    ({"size": 0, "page_size": 4}, "size must be a positive int, got 0"),
    ({"size": 16, "page_size": -1}, "page_size must be a positive int"),
    ({"size": 16, "page_size": 4, "layout": "head_first"}, "unknown layout 'head_first'; supported: layer_first"),
    ({"size": 16, "page_size": 4, "device": "warp9"}, "invalid device"),
])
def test_host_pool_construction_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HostKVPool(SPEC, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works where an accelerator exists")
def test_pin_memory_without_accelerator_says_so():
    with pytest.raises(ValueError, match="pin_memory=True needs an accelerator"):
        HostKVPool(SPEC, 16, 4, pin_memory=True)
    assert not HostKVPool(SPEC, 16, 4).raw.is_pinned()


def test_from_buffers_errors():
    good = {n: [torch.zeros(8, c.head_num, c.head_dim, dtype=SPEC.dtype) for _ in range(3)]
            for n, c in zip(SPEC.names, SPEC.components)}
    cases = [
        ({"k": good["k"]}, "exactly the components"),
        ({**good, "extra": good["k"]}, "exactly the components"),
        ({**good, "v": good["v"][:2]}, "has 2 layers, spec has 3"),
        ({**good, "v": [torch.zeros(8, 4, 12, dtype=SPEC.dtype)] * 3}, r"shape \(8, 4, 12\), expected \(8, 4, 8\)"),
        ({**good, "v": [t.float() for t in good["v"]]}, "dtype torch.float32"),
        ({**good, "v": [torch.zeros(8, 4, 8, dtype=SPEC.dtype, device="meta")] * 3}, "is on meta"),
    ]
    for buffers, match in cases:
        with pytest.raises(ValueError, match=match):
            DeviceKVPool.from_buffers(SPEC, buffers, 4)
    with pytest.raises(ValueError, match="size 8 is not a multiple of page_size 3"):
        DeviceKVPool.from_buffers(SPEC, good, 3)


def test_device_pool_accessors():
    dev = DeviceKVPool(SPEC, 16, 4)
    assert len(dev.k_buffer) == 3 and tuple(dev.v_buffer[2].shape) == (16, 4, 8)
    assert dev.buffer("v", 2).data_ptr() == dev.v_buffer[2].data_ptr()
    with pytest.raises(ValueError, match="unknown component 'kv'"):
        dev.buffer("kv", 0)
    with pytest.raises(ValueError, match=r"layer 3 is out of range \[0, 3\)"):
        dev.buffer("k", 3)
    with pytest.raises(AttributeError, match="no component 'v'"):
        DeviceKVPool(SPECS["mla"], 4, 4).v_buffer
    idx = dev.alloc(8)
    assert idx.tolist() == list(range(8)) and dev.available_size() == 8
    dev.free(idx)
    assert dev.available_size() == 16


def test_a_pool_on_cuda_names_the_device_its_tensors_report(monkeypatch):
    """``cuda`` means the current CUDA device: a pool keeps it as ``cuda:N``, the device its
    tensors (and the slots it hands out) report, so its own indices are on its device
    (``torch.device`` compares the index: ``cuda:0 != cuda``; before, a pool made with
    ``device="cuda"`` refused the indices it handed out). Checked without a GPU."""
    from kvtier.pools.common import check_device, parse_device

    assert parse_device("cuda") == torch.device("cuda")  # no CUDA here: nothing to name
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert parse_device("cuda") == parse_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert check_device("cuda") == torch.device("cuda", 1)
    assert parse_device("cuda:0") == check_device("cuda:0") == torch.device("cuda", 0)
    assert parse_device("cpu") == check_device("cpu") == torch.device("cpu")
    assert parse_device("meta") == torch.device("meta")


def test_a_meta_pool_copies_with_meta_pools_only():
    """A ``meta`` pool has shapes and no memory (the simulator's). Between two, a copy is
    checked and moves nothing; between one and a real pool it would move nothing
    silently, leaving stale bytes where the caller expects KV: refused, both ways, plain
    and hybrid, as are a hybrid pool's groups on several devices."""
    from kvtier import HybridDevicePool, HybridHostPool
    from tests.support.pools import HYBRID_SPECS

    spec, ps = KVSpec.mha(2, 2, 4, dtype=torch.float32), 4
    s = slots([1], ps)
    meta_dev, meta_host = DeviceKVPool(spec, 16, ps, device="meta"), HostKVPool(spec, 16, ps, device="meta")
    meta_host.backup_from_device_all_layer(meta_dev, s, s)
    meta_host.load_to_device_per_layer(meta_dev, s, s, 0)
    host, dev = HostKVPool(spec, 16, ps), DeviceKVPool(spec, 16, ps)
    for call in (lambda: host.backup_from_device_all_layer(meta_dev, s, s),
                 lambda: meta_host.load_to_device_per_layer(dev, s, s, 0),
                 lambda: meta_host.load_to_device_layers(dev, s, s, range(2))):
        with pytest.raises(ValueError, match="a meta pool"):
            call()
    hybrid = HYBRID_SPECS["mimo"]
    with pytest.raises(ValueError, match="a meta pool"):
        HybridHostPool(hybrid, 16, ps).backup_from_device_all_layer(HybridDevicePool(hybrid, 16, ps, device="meta"),
                                                                    {}, {})
    groups = {g.name: DeviceKVPool(g.spec, 16, ps, device="meta" if i else "cpu") for i, g in enumerate(hybrid.groups)}
    with pytest.raises(ValueError, match="one device"):
        HybridDevicePool.from_pools(hybrid, groups)
