"""kvtier host pools built by sglang's own factory after ``install_host_pool()``, driven
by sglang's HiCacheController on the CPU (sglang's ``MHATokenToKVPool`` as the device pool).
"""

import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation as HybridPrefetchOperation  # noqa: E402,E501
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import StorageOperation as HybridStorageOperation  # noqa: E402,E501
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import HostKVCache  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import AsymmetricMHATokenToKVPoolHost, MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.runtime_context import _CONTEXT, get_parallel  # noqa: E402

from kvtier import UnsupportedLayoutError  # noqa: E402
from kvtier.integrations.sglang import (KVTierMHAHostPool, KVTierStorage, install_host_pool,  # noqa: E402
                                       uninstall_host_pool)
from tests.support.sglang_rig import (PAGE_SIZE, attach, backup, bits, build_host_pool, device_pool,  # noqa: E402
                                      fill_random, kvtier_config, page_keys, pools, prefetch, same_tokens,
                                      sglang_pool, token_major)

LAYERS = 3
DTYPE = torch.bfloat16
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


@pytest.fixture
def installed():
    install_host_pool()
    yield
    uninstall_host_pool()


def factory_choice(device):
    return hybrid_pool_assembler.get_mha_host_pool_cls(device.get_device_pool_infos()[0].buffer_info)


# -- the factory -----------------------------------------------------------------------------
def test_without_install_sglang_refuses_asymmetric_layer_first_and_page_head():
    device = device_pool()
    assert factory_choice(device) is AsymmetricMHATokenToKVPoolHost
    for layout in ("layer_first", "page_head"):
        with pytest.raises(ValueError, match="Unsupported layout for models with head_dim != v_head_dim"):
            sglang_pool(layout, device)
    with pytest.raises(NotImplementedError):
        sglang_pool("page_first", device).get_split_heads_page_buffer_meta(torch.arange(PAGE_SIZE), 2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sglang_factory_builds_kvtier_pools_for_asymmetric_kv_in_every_layout(installed, layout):
    device, host = pools(layout, head_num=4, head_dim=16, v_head_dim=8)
    assert type(host) is KVTierMHAHostPool and isinstance(host, HostKVCache)
    assert host.layout == layout and host.page_size == PAGE_SIZE and host.layer_num == LAYERS
    assert (host.head_num, host.head_dim, host.v_head_dim) == (4, 16, 8)
    size, pages = host.size, host.size // PAGE_SIZE
    assert size == 2 * 256 + PAGE_SIZE  # sglang's sizing: ratio x device tokens, plus its padding page
    shapes = {"layer_first": (LAYERS, size, 4), "page_first": (size, LAYERS, 4),
              "page_first_direct": (pages, LAYERS, PAGE_SIZE, 4), "page_head": (pages, 4, PAGE_SIZE, LAYERS)}[layout]
    assert tuple(host.k_buffer.shape) == shapes + (16,) and tuple(host.v_buffer.shape) == shapes + (8,)
    assert host.k_buffer.untyped_storage().data_ptr() == host.v_buffer.untyped_storage().data_ptr()  # one allocation
    assert host.size_per_token == LAYERS * 4 * (16 + 8) * 2 and host.get_ksize_per_token() == LAYERS * 4 * 16 * 2
    assert host.available_size() == size and host.can_use_write_back_jit is False
    assert host.shared_allocation_domain is None and host.stores_page_envelope is False
    assert host.storage_format_tag is None and host.pool_label == "kv"
    slots = host.alloc(2 * PAGE_SIZE)
    assert slots.tolist() == list(range(2 * PAGE_SIZE)) and host.available_size() == size - 2 * PAGE_SIZE
    host.free(slots)
    host.clear()
    assert host.available_size() == size
    host.destroy()
    assert host.kv_buffer is None


def test_symmetric_mha_and_mla_keep_sglang_pools_unless_asked():
    mla = MLATokenToKVPool(size=64, page_size=PAGE_SIZE, dtype=DTYPE, kv_lora_rank=32, qk_rope_head_dim=8,
                           layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    symmetric, asymmetric = device_pool(v_head_dim=16), device_pool(v_head_dim=8)
    try:
        install_host_pool()
        assert factory_choice(symmetric) is MHATokenToKVPoolHost
        assert factory_choice(asymmetric) is KVTierMHAHostPool
        assert hybrid_pool_assembler.is_mla_pool(mla)  # build_kv_host_pool takes MLATokenToKVPoolHost, not the factory
        install_host_pool(symmetric=True)
        assert type(build_host_pool("page_head", symmetric)) is KVTierMHAHostPool
    finally:
        uninstall_host_pool()
    assert factory_choice(symmetric) is MHATokenToKVPoolHost and factory_choice(asymmetric) is \
        AsymmetricMHATokenToKVPoolHost
    assert hybrid_pool_assembler.get_mha_host_pool_cls.__module__ == "sglang.srt.mem_cache.pool_host.mha"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_per_layer_views_and_row_width_as_sglangs_symmetric_pool_has_them(layout):
    device = device_pool(head_num=2, head_dim=16, v_head_dim=16)
    install_host_pool(symmetric=True)
    try:
        ours, asymmetric = build_host_pool(layout, device), build_host_pool(layout, device_pool(v_head_dim=8))
    finally:
        uninstall_host_pool()
    assert ours.token_stride_size == 2 * 16 * 2
    refs = ours.host_kv_data_refs
    assert len(refs) == 2 * LAYERS
    for i, ref in enumerate(refs):  # layer i % LAYERS of K, then of V
        name, layer = ("k", "v")[i // LAYERS], i % LAYERS
        expected = token_major(ours, name)[:, layer]
        assert torch.equal(bits(ref.reshape(expected.shape) if layout != "page_head" else
                                ref.permute(0, 2, 1, 3).flatten(0, 1)), bits(expected))
    if layout == "layer_first":
        assert all(ref.is_contiguous() for ref in refs)
    assert not hasattr(asymmetric, "token_stride_size")  # no single row width, as in sglang's asymmetric pool


# -- L2 transfers through the controller -------------------------------------------------------
class _Allocator:
    """What HiCacheController asks of sglang's device allocator: pages of device slots."""

    def __init__(self, device, first_page=1):
        self.device = device
        self.next_page = first_page

    def get_kvcache(self):
        return self.device

    def alloc(self, n):
        start = self.next_page * PAGE_SIZE
        self.next_page += n // PAGE_SIZE
        return torch.arange(start, start + n, device=self.device.device)

    def set_hicache_transfer_done_event(self, key, event):
        pass


def fill_device(device, seed):
    gen = torch.Generator().manual_seed(seed)
    for buf in device.k_buffer + device.v_buffer:
        bits(buf).copy_(torch.randint(-2 ** 15, 2 ** 15, buf.shape, generator=gen, dtype=torch.int32).to(torch.int16))


def host_matches_device(host, host_slots, device, device_slots):
    host_slots, device_slots = host_slots.cpu(), device_slots.cpu()
    return all(torch.equal(bits(token_major(host, name)[host_slots][:, layer]), bits(layers[layer].cpu()[device_slots]))
               for name, layers in (("k", device.k_buffer), ("v", device.v_buffer)) for layer in range(LAYERS))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


CONTROLLER_PATHS = [(lay, "kernel") for lay in LAYOUTS] + [("layer_first", "direct"), ("page_first_direct", "direct")]


@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.parametrize("layout, io_backend", CONTROLLER_PATHS)  # sglang's move_indices allows these for "direct"
def test_controller_backs_up_and_loads_every_layer_bit_exactly(installed, layout, io_backend, device_type):
    device, host = pools(layout, head_num=4, head_dim=16, v_head_dim=8, tokens=256, device=device_type)
    assert host.pin_memory == (device_type == "cuda")  # pinned exactly where an accelerator exists
    fill_device(device, seed=3)
    allocator = _Allocator(device, first_page=40)
    controller = HiCacheController(allocator, host, PAGE_SIZE, tp_group=None, load_cache_event=threading.Event(),
                                   io_backend=io_backend)
    dev_pages = [9, 2, 31, 5]
    src = torch.cat([torch.arange(p * PAGE_SIZE, (p + 1) * PAGE_SIZE) for p in dev_pages]).to(device_type)
    host.alloc(PAGE_SIZE)  # so host and device slots differ
    host_slots = controller.write(src, node_id=1)
    synchronize(device_type)
    assert host_slots.tolist() == list(range(PAGE_SIZE, 5 * PAGE_SIZE))
    assert host_matches_device(host, host_slots, device, src)
    loaded = controller.load(host_slots, node_id=1)
    assert loaded.tolist() == list(range(40 * PAGE_SIZE, 44 * PAGE_SIZE))
    assert not host_matches_device(host, host_slots, device, loaded)
    controller.start_loading()
    synchronize(device_type)
    assert host_matches_device(host, host_slots, device, loaded)
    for name, layers in (("k", device.k_buffer), ("v", device.v_buffer)):
        for layer in range(LAYERS):  # the load wrote exactly the source bytes, layer by layer
            assert torch.equal(bits(layers[layer][loaded]), bits(layers[layer][src]))


def synchronize(device_type):
    if device_type == "cuda":  # the controller's copies run on its own streams
        torch.cuda.synchronize()


def test_a_load_of_a_layer_the_pool_does_not_hold_does_nothing(installed):
    device, host = pools("page_head")
    before = host.k_buffer.clone()
    host.load_to_device_per_layer(device, torch.arange(PAGE_SIZE), torch.arange(PAGE_SIZE), LAYERS, "direct")
    assert torch.equal(bits(host.k_buffer), bits(before))
    with pytest.raises(ValueError, match="multiple of page_size"):
        host.backup_from_device_all_layer(device, torch.arange(1, 1 + PAGE_SIZE), torch.arange(PAGE_SIZE), "direct")


# -- zero-copy metadata ------------------------------------------------------------------------
@pytest.mark.parametrize("split", [2, 4, 8])
def test_split_heads_spans_cover_exactly_each_head_range(installed, split):
    device, host = pools("page_head", head_num=8, head_dim=16, v_head_dim=8)
    pages = [3, 0, 7]
    indices = torch.cat([torch.arange(p * PAGE_SIZE, (p + 1) * PAGE_SIZE) for p in pages])
    ptrs, sizes = host.get_split_heads_page_buffer_meta(indices, split)
    group = 8 // split
    expected = [(buf[p, g * group:(g + 1) * group].data_ptr(), buf[p, g * group:(g + 1) * group].nbytes)
                for p in pages for g in range(split) for buf in (host.k_buffer, host.v_buffer)]
    assert list(zip(ptrs, sizes)) == expected
    assert all(buf[p, g * group:(g + 1) * group].is_contiguous()
               for p in pages for g in range(split) for buf in (host.k_buffer, host.v_buffer))
    # the spans of a page tile its K page and its V page, no gap, no overlap
    per_page = 2 * split
    for i, p in enumerate(pages):
        spans = list(zip(ptrs, sizes))[i * per_page:(i + 1) * per_page]
        for c, buf in enumerate((host.k_buffer, host.v_buffer)):
            mine = spans[c::2]
            assert mine[0][0] == buf[p].data_ptr() and sum(s for _, s in mine) == buf[p].nbytes
            assert all(a + s == b for (a, s), (b, _) in zip(mine, mine[1:]))
    assert host.get_page_buffer_element_size(split) == sizes[0] == PAGE_SIZE * LAYERS * group * 16 * 2


def test_split_heads_needs_page_head_and_divisible_heads(installed):
    _, host = pools("page_first", head_num=8)
    with pytest.raises(UnsupportedLayoutError, match="page_head"):
        host.get_split_heads_page_buffer_meta(torch.arange(PAGE_SIZE), 2)
    _, host = pools("page_head", head_num=4)
    with pytest.raises(ValueError, match="not divisible"):
        host.get_split_heads_page_buffer_meta(torch.arange(PAGE_SIZE), 8)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_page_buffer_meta_lays_pages_out_as_sglangs_asymmetric_pool(layout):
    """Same spans (offsets from each buffer's base, sizes) as sglang's own pool: a
    Mooncake store written by either is read by the other."""
    device = device_pool(head_num=4, head_dim=16, v_head_dim=8)
    theirs = sglang_pool(layout, device)
    install_host_pool()
    try:
        ours = build_host_pool(layout, device)
    finally:
        uninstall_host_pool()
    indices = torch.arange(6 * PAGE_SIZE, 9 * PAGE_SIZE)

    def relative(pool):
        ptrs, sizes = pool.get_page_buffer_meta(indices)
        bases = (pool.k_buffer.data_ptr(), pool.v_buffer.data_ptr())
        return [(p - bases[i % 2], s) for i, (p, s) in enumerate(zip(ptrs, sizes))]

    assert relative(ours) == relative(theirs)
    assert ours.get_ksize_per_token() == theirs.get_ksize_per_token()
    assert ours.size_per_token == theirs.size_per_token and ours.size == theirs.size


# -- flat pages ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_flat_pages_are_in_sglangs_byte_order(layout):
    """A symmetric model, where sglang has flat pages: kvtier's pool (symmetric=True)
    gives the same bytes for the same tokens, and takes sglang's pages back."""
    device = device_pool(head_num=2, head_dim=16, v_head_dim=16)
    theirs = sglang_pool(layout, device)
    install_host_pool(symmetric=True)
    try:
        ours = build_host_pool(layout, device)
    finally:
        uninstall_host_pool()
    fill_random(theirs, seed=5)
    ours.k_buffer.copy_(theirs.k_buffer)  # the same shapes: sglang's views of kvtier's buffers
    ours.v_buffer.copy_(theirs.v_buffer)
    for index in (0, 3 * PAGE_SIZE):
        assert torch.equal(bits(ours.get_data_page(index)), bits(theirs.get_data_page(index)))
    page = theirs.get_data_page(2 * PAGE_SIZE)
    ours.set_from_flat_data_page(7 * PAGE_SIZE, page)
    assert torch.equal(bits(ours.get_data_page(7 * PAGE_SIZE)), bits(page))
    assert ours.get_dummy_flat_data_page().numel() == theirs.get_dummy_flat_data_page().numel()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_asymmetric_flat_pages_round_trip(installed, layout):
    _, host = pools(layout)
    fill_random(host, seed=9)
    page = host.get_data_page(4 * PAGE_SIZE)
    k_elems = PAGE_SIZE * LAYERS * 4 * 16
    assert page.numel() == host.get_dummy_flat_data_page().numel() == k_elems + PAGE_SIZE * LAYERS * 4 * 8
    host.set_from_flat_data_page(9 * PAGE_SIZE, page)
    slots = torch.arange(4 * PAGE_SIZE, 5 * PAGE_SIZE)
    assert same_tokens(host, slots, host, slots + 5 * PAGE_SIZE)
    with pytest.raises(ValueError, match="elements"):
        host.set_from_flat_data_page(0, page[:-1])


# -- L3 through the controller with kvtier's storage backend ---------------------------------------
PAGES = 130  # two controller batches
TOKENS = list(range(7000, 7000 + PAGES * PAGE_SIZE))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("interface_v1", [1, 0])
def test_kvtier_storage_round_trips_asymmetric_pages(installed, layout, interface_v1, tmp_path):
    device, host = pools(layout, tokens=600)  # room for two copies of PAGES
    fill_random(host, seed=11)
    controller = attach(device, host, extra_config=kvtier_config(f"file://{tmp_path}", interface_v1=interface_v1))
    src = host.alloc(PAGES * PAGE_SIZE)
    assert backup(controller, src, TOKENS) == PAGES * PAGE_SIZE
    hit, pages, dst = prefetch(controller, host, TOKENS)
    assert (hit, pages) == (PAGES * PAGE_SIZE, PAGES)
    assert same_tokens(host, src, host, dst)
    controller.detach_storage_backend()


def test_asymmetric_page_head_pages_written_at_tp2_are_read_at_tp1_and_tp4(installed, tmp_path):
    url, heads = f"file://{tmp_path}", 8
    writers = []
    for rank in range(2):
        device, host = pools("page_head", head_num=heads // 2, tokens=512)
        fill_random(host, seed=20 + rank)
        controller = attach(device, host, extra_config=kvtier_config(url), tp_rank=rank, tp_size=2)
        src = host.alloc(PAGES * PAGE_SIZE)
        assert backup(controller, src, TOKENS) == PAGES * PAGE_SIZE
        writers.append((host, src))
    for tp_size, layout in ((1, "layer_first"), (4, "page_head")):
        for rank in range(tp_size):
            device, host = pools(layout, head_num=heads // tp_size, tokens=512)
            controller = attach(device, host, extra_config=kvtier_config(url), tp_rank=rank, tp_size=tp_size)
            hit, pages, dst = prefetch(controller, host, TOKENS)
            assert pages == PAGES
            first = rank * heads // tp_size  # global heads [first, first + heads // tp_size) of this reader
            for w, (whost, wsrc) in enumerate(writers):
                lo, hi = max(first, 4 * w), min(first + heads // tp_size, 4 * w + 4)
                if lo < hi:
                    assert all(torch.equal(bits(token_major(host, n)[dst][:, :, lo - first:hi - first]),
                                           bits(token_major(whost, n)[wsrc][:, :, lo - 4 * w:hi - 4 * w]))
                               for n in ("k", "v"))


# -- sglang's whole KV-only stack: HostPoolGroup + HybridCacheController ---------------------------
def kv_only_stack(layout, io_backend, device, drafts=(), storage=None):
    """What sglang's plain-KV strategy builds (``build_kv_only_stack``), storage attached."""
    params = SimpleNamespace(page_size=PAGE_SIZE, mtp_draft_device_pools=tuple(drafts),
                             token_to_kv_pool_allocator=_Allocator(device, first_page=40), tp_cache_group=None,
                             attn_cp_cache_group=None, attn_tp_cache_group=None, pp_cache_group=None)
    with _CONTEXT.override_server_args(hicache_ratio=2.0, hicache_size=0, hicache_mem_layout=layout,
                                       hicache_io_backend=io_backend), \
            get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
        group, controller = hybrid_pool_assembler.build_kv_only_stack(
            params=params, kv_pool=device, full_layer_mapping={i: i for i in range(LAYERS)},
            load_cache_event=threading.Event(), storage_backend="dynamic" if storage else None, use_mla=False,
            model_name="tiny-asym", storage_backend_extra_config=storage)
    if storage:
        controller._stop_storage_threads()
    return group, controller


@pytest.mark.parametrize("layout, io_backend", CONTROLLER_PATHS)
def test_host_pool_group_and_hybrid_controller_move_target_and_packed_draft_layers(installed, layout, io_backend,
                                                                                   tmp_path):
    device, draft = device_pool(tokens=512), MHATokenToKVPool(
        size=512, page_size=PAGE_SIZE, dtype=DTYPE, head_num=4, head_dim=16, layer_num=1, device="cpu",
        enable_memory_saver=False, v_head_dim=8, start_layer=0, end_layer=1)
    fill_device(device, seed=31)
    fill_device(draft, seed=32)
    group, controller = kv_only_stack(layout, io_backend, device, drafts=[draft],
                                      storage=kvtier_config(f"file://{tmp_path}"))
    host = group.anchor_entry.host_pool
    assert type(host) is KVTierMHAHostPool and host.layer_num == LAYERS + 1 and host.target_layer_num == LAYERS
    assert isinstance(controller.storage_backend, KVTierStorage)
    src = torch.cat([torch.arange(p * PAGE_SIZE, (p + 1) * PAGE_SIZE) for p in (7, 3, 11)])
    host_slots = controller.write(src, node_id=1)
    layers = [(device, layer, layer) for layer in range(LAYERS)] + [(draft, 0, LAYERS)]  # (pool, its layer, host layer)

    def host_holds(host_pool, slots, dev_slots):
        return all(torch.equal(bits(token_major(host_pool, n)[slots][:, hl]),
                               bits(getattr(p, f"{n}_buffer")[l][dev_slots]))
                   for n in ("k", "v") for p, l, hl in layers)

    assert host_holds(host, host_slots, src)
    loaded = controller.load(host_slots, node_id=1)
    controller.start_loading()
    assert host_holds(host, host_slots, loaded)
    # then L3 through the same controller: back up, and prefetch into fresh host slots
    tokens = list(range(300, 300 + len(src)))
    backup_op = HybridStorageOperation(host_slots, tokens, hash_value=page_keys(tokens), prefix_keys=[])
    controller._page_backup(backup_op)
    assert backup_op.completed_tokens == len(src)
    prefetch_op = HybridPrefetchOperation(SimpleNamespace(rid="request"), tokens, prefix_keys=[])
    hashes, hit = controller._storage_hit_query(prefetch_op)
    fresh = host.alloc(hit)
    prefetch_op.host_indices, prefetch_op.hash_value = fresh, hashes
    controller._page_transfer(prefetch_op)
    pages = controller.prefetch_sync_queue.get_nowait().completed_tokens // PAGE_SIZE  # the transfer's ack
    assert (hit, pages) == (len(src), 3) and same_tokens(host, host_slots, host, fresh)
    controller.detach_storage_backend()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sglangs_own_file_backend_stores_asymmetric_flat_pages(installed, layout, tmp_path):
    """sglang's ``file`` backend moves pages with get_data_page/set_from_flat_data_page,
    which sglang's asymmetric pool refuses; the files hold sglang's flat byte order."""
    device, host = pools(layout, tokens=64)
    fill_random(host, seed=41)
    controller = attach(device, host, backend="file", extra_config={"file_storage_path": str(tmp_path)})
    src = host.alloc(3 * PAGE_SIZE)
    tokens = list(range(900, 900 + 3 * PAGE_SIZE))
    assert backup(controller, src, tokens) == 3 * PAGE_SIZE
    files = sorted(tmp_path.glob(f"{page_keys(tokens)[1]}*.bin"))
    assert len(files) == 1
    assert files[0].read_bytes() == host.get_data_page(int(src[PAGE_SIZE])).view(torch.uint8).numpy().tobytes()
    hit, pages, dst = prefetch(controller, host, tokens)
    assert (hit, pages) == (3 * PAGE_SIZE, 3) and same_tokens(host, src, host, dst)


def test_unsupported_host_pool_error_is_kvtiers_and_still_a_value_error():
    from kvtier import errors
    from kvtier.integrations.sglang.host_pool import UnsupportedHostPoolError

    assert UnsupportedHostPoolError is errors.UnsupportedHostPoolError
    assert issubclass(UnsupportedHostPoolError, errors.UnsupportedError)
    assert issubclass(UnsupportedHostPoolError, ValueError)  # callers catch ValueError
