"""KVTierStorage on hybrid models' host pools: sglang's own hybrid assembler builds the
``HostPoolGroup`` (an anchor ``KV`` pool for the full layers, an ``SWA`` pool for the
sliding ones) over CPU device pools, sglang's ``StorageBackendFactory`` builds the
backend, and the pools register through v2 as ``HybridCacheController.attach_storage_backend``
registers them. The v2 calls are made as the controller makes them (its storage
threads need CUDA streams for the device side): SWA pages written before KV, the
hit query with placeholder SWA keys (only their count, the window in pages, matters),
sidecar reads with the real keys of the window before the hit.

Geometries: MiMo-V2-Flash in small (K 16 / V 8, twice the KV heads on SWA: sglang's
asymmetric host pool, page_first and page_first_direct) and gpt-oss (K = V, the same
geometry on both pools: every layout)."""

import hashlib

import pytest

pytest.importorskip("sglang.srt")

import sglang.srt.mem_cache.pool_host.common as sglang_host_common  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (HiCacheFile, HiCacheStorageConfig, PoolHitPolicy,  # noqa: E402
                                                  PoolName, PoolTransfer)
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_hybrid_swa_group  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.runtime_context import get_context, restore_context, snapshot_context  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from kvtier.integrations.sglang.pools import UnsupportedPoolError  # noqa: E402
from kvtier.testing.checkpoints import save_llama  # noqa: E402
from tests.support.sglang_rig import (PAGE_SIZE, bits, fill_random, kvtier_config, mha_pools, page_keys,  # noqa: E402
                                      token_major)

GEOMETRIES = {  # full heads, sliding heads, K dim, V dim; full and sliding layer ids
    "mimo": (2, 4, 16, 8, (0, 4), (1, 2, 3)),
    "gpt-oss": (2, 2, 16, 16, (1, 3), (0, 2)),
}
CASES = [("mimo", lay) for lay in ("page_first", "page_first_direct")] + \
        [("gpt-oss", lay) for lay in ("layer_first", "page_first", "page_first_direct", "page_head")]
WINDOW = 2  # pages of the sliding window


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_llama(tmp_path_factory.mktemp("stand-in"), layers=2))  # ServerArgs needs a model


@pytest.fixture(autouse=True)
def published_config():
    """sglang's process-wide configuration as it was: the assembler needs published server
    args, and other tests' parallel overrides and namespaces must not see them."""
    state = snapshot_context()
    yield
    restore_context(state)


@pytest.fixture(autouse=True)
def cpu_host_memory(monkeypatch):
    # NOTE: sglang's hybrid assembler asks for pinned host pools, which this CPU build
    # of torch cannot register with CUDA; the pools' memory is otherwise sglang's.
    monkeypatch.setattr(sglang_host_common, "_cuda_host_register", lambda *a, **k: None)


def hybrid_group(checkpoint: str, model: str, layout: str, seed: int = 1, tp_size: int = 1, heads: int = 1):
    """sglang's HostPoolGroup for ``model``'s pools in ``layout``, filled with random bytes:
    ``heads`` times the geometry's heads, this rank's share of ``tp_size``."""
    full_heads, swa_heads, k_dim, v_dim, full_layers, swa_layers = GEOMETRIES[model]
    # NOTE: sglang gives each rank max(1, heads // tp_size) heads: replicas beyond the head count
    full_heads, swa_heads = max(1, full_heads * heads // tp_size), max(1, swa_heads * heads // tp_size)
    get_context().set_server_args(ServerArgs(model_path=checkpoint, device="cpu", enable_hierarchical_cache=True,
                                             hicache_mem_layout=layout, hicache_ratio=2.0))

    def device(heads, layers):
        return MHATokenToKVPool(size=256, page_size=PAGE_SIZE, dtype=torch.bfloat16, head_num=heads, head_dim=k_dim,
                                layer_num=layers, device="cpu", enable_memory_saver=False, v_head_dim=v_dim)

    group = build_hybrid_swa_group(page_size=PAGE_SIZE, full_kv_pool=device(full_heads, len(full_layers)),
                                   swa_kv_pool=device(swa_heads, len(swa_layers)),
                                   full_layer_mapping={layer: i for i, layer in enumerate(full_layers)},
                                   swa_layer_mapping={layer: i for i, layer in enumerate(swa_layers)}, use_mla=False)
    for i, entry in enumerate(group.entries):
        fill_random(entry.host_pool, seed * 10 + i)
    return group


def pools(group) -> dict:
    return {e.name: e.host_pool for e in group.entries}


def config(extra: dict, model_name: str = "tiny-hybrid", tp_rank: int = 0, tp_size: int = 1) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name=model_name, extra_config=extra)


def attach(group, url: str, tp_rank: int = 0, tp_size: int = 1):
    """The backend as HybridCacheController.attach_storage_backend sets it up."""
    anchor = group.anchor_entry.host_pool
    backend = StorageBackendFactory.create_backend("dynamic", config(kvtier_config(url), tp_rank=tp_rank,
                                                                     tp_size=tp_size), anchor)
    backend.register_mem_pool_host(anchor)  # the controller's attach: the anchor first, then the v2 burst
    for entry in group.entries:
        backend.register_mem_host_pool_v2(entry.host_pool, entry.name)
    backend.on_host_pools_registered()
    return backend


def trailing(n: int = WINDOW, host_indices=None, keys=None) -> PoolTransfer:
    keys = keys or [f"placeholder{i}" for i in range(n)]
    return PoolTransfer(name=PoolName.SWA, host_indices=host_indices, keys=keys,
                        hit_policy=PoolHitPolicy.TRAILING_PAGES)


def tokens(pages: int, start: int = 1000) -> list[int]:
    return list(range(start, start + pages * PAGE_SIZE))


def backup(backend, group, hashes: list[str], kv_slots=None, swa_pages=WINDOW):
    """The controller's backup of a sequence: its window's SWA pages first, then KV.
    Returns the host slots written ``(kv, swa)``."""
    host = pools(group)
    kv_slots = host[PoolName.KV].alloc(len(hashes) * PAGE_SIZE) if kv_slots is None else kv_slots
    swa_slots = host[PoolName.SWA].alloc(swa_pages * PAGE_SIZE)
    done = backend.batch_set_v2([trailing(host_indices=swa_slots, keys=hashes[-swa_pages:])])
    assert done == {"swa": [True] * swa_pages}
    assert backend.batch_set_v1(hashes, kv_slots) == [True] * len(hashes)
    return kv_slots, swa_slots


def restore(backend, group, hashes: list[str]):
    """The controller's hit query, then the KV pages of the hit and the SWA window
    before it: ``(hit pages, kv slots, swa slots, swa results)``."""
    result = backend.batch_exists_v2(hashes, [trailing()])
    hit = result.kv_hit_pages
    host = pools(group)
    kv = host[PoolName.KV].alloc(hit * PAGE_SIZE)
    assert backend.batch_get_v1(hashes[:hit], kv) == [True] * hit
    swa = host[PoolName.SWA].alloc(WINDOW * PAGE_SIZE)
    got = backend.batch_get_v2([trailing(host_indices=swa, keys=hashes[hit - WINDOW:hit])])
    return result, kv, swa, got["swa"]


def same(host_a, slots_a, host_b, slots_b, heads_a: slice = slice(None)) -> bool:
    """Whether heads ``heads_a`` of ``host_a``'s tokens hold bit for bit what ``host_b``'s hold."""
    return all(torch.equal(bits(token_major(host_a, n)[slots_a][:, :, heads_a]), bits(token_major(host_b, n)[slots_b]))
               for n in ("k", "v"))


@pytest.mark.parametrize("model, layout", CASES)
def test_both_pools_round_trip_bit_exact_into_a_new_backend(checkpoint, model, layout, tmp_path):
    url = f"file://{tmp_path}"
    writer = hybrid_group(checkpoint, model, layout, seed=1)
    hashes = page_keys(tokens(6))
    kv_w, swa_w = backup(attach(writer, url), writer, hashes)
    reader = hybrid_group(checkpoint, model, layout, seed=2)
    result, kv_r, swa_r, swa_ok = restore(attach(reader, url), reader, hashes)
    assert result.kv_hit_pages == 6 and result.restorable_prefix_pages == [6] and swa_ok == [True, True]
    assert result.extra_pool_hit_pages == {"kv": 6, "swa": 6}
    assert same(pools(writer)[PoolName.KV], kv_w, pools(reader)[PoolName.KV], kv_r)
    assert same(pools(writer)[PoolName.SWA], swa_w, pools(reader)[PoolName.SWA], swa_r)


def test_restorable_prefixes_are_the_ends_of_whole_windows(checkpoint, tmp_path):
    """Two prompts of one prefix (6 and 10 pages) store the windows before their ends:
    SWA pages 4-5 and 8-9. Restorable: 6 and 10. Without page 9's SWA object only 6;
    a corrupt one is a miss when read, and removed, so the next query stops at 6 too."""
    group = hybrid_group(checkpoint, "mimo", "page_first")
    backend = attach(group, f"file://{tmp_path}")
    hashes = page_keys(tokens(10))
    kv, _ = backup(backend, group, hashes[:6])
    backup(backend, group, hashes, kv_slots=torch.cat([kv, pools(group)[PoolName.KV].alloc(4 * PAGE_SIZE)]))
    result = backend.batch_exists_v2(hashes, [trailing()])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (10, [6, 10])
    swa = backend.binding("swa")
    swa.store.delete(swa.keys(hashes[9:10]))
    result = backend.batch_exists_v2(hashes, [trailing()])
    assert (result.kv_hit_pages, result.restorable_prefix_pages, result.extra_pool_hit_pages) == \
        (6, [6], {"kv": 10, "swa": 6})
    # a corrupt SWA page (page 5): present, but its read fails and removes it
    key = swa.keys(hashes[5:6])[0]
    h = hashlib.sha256(key.encode()).hexdigest()  # file:// layout: <dir>/kvtier-v5/<h[:2]>/<h[2:]>.<field>
    victim = sorted((tmp_path / "kvtier-v5" / h[:2]).glob(f"{h[2:]}.*"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    _, _, _, swa_ok = restore(backend, group, hashes)
    assert swa_ok == [True, False]
    assert backend.batch_exists_v2(hashes, [trailing()]).restorable_prefix_pages == []


def test_pools_of_one_geometry_keep_their_own_pages(checkpoint, tmp_path):
    """gpt-oss: KV and SWA pools alike; the same page hash names two objects."""
    group = hybrid_group(checkpoint, "gpt-oss", "page_first")
    backend = attach(group, f"file://{tmp_path}")
    host = pools(group)
    assert backend.binding("kv").pool.spec == backend.binding("swa").pool.spec  # one geometry
    hashes = page_keys(tokens(2))
    kv_w, swa_w = backup(backend, group, hashes)
    reader = hybrid_group(checkpoint, "gpt-oss", "page_first", seed=3)
    _, kv_r, swa_r, ok = restore(attach(reader, f"file://{tmp_path}"), reader, hashes)
    assert ok == [True, True]
    assert same(host[PoolName.KV], kv_w, pools(reader)[PoolName.KV], kv_r)
    assert same(host[PoolName.SWA], swa_w, pools(reader)[PoolName.SWA], swa_r)
    assert not same(host[PoolName.KV], kv_w, pools(reader)[PoolName.SWA], swa_r)  # different bytes, kept apart
    kv_key, swa_key = backend.binding("kv").keys(hashes[:1])[0], backend.binding("swa").keys(hashes[:1])[0]
    assert kv_key != swa_key and swa_key.endswith("~swa")


def test_a_page_stored_already_is_kept_and_reported_stored(checkpoint, tmp_path):
    """sglang's contract: content-hashed keys, so a second set of a key keeps the first
    bytes and answers True (a rewrite would be wasted I/O)."""
    group = hybrid_group(checkpoint, "mimo", "page_first")
    backend = attach(group, f"file://{tmp_path}")
    host = pools(group)[PoolName.KV]
    hashes = page_keys(tokens(2))
    first = host.alloc(2 * PAGE_SIZE)
    assert backend.batch_set_v1(hashes, first) == [True, True]
    other = host.alloc(2 * PAGE_SIZE)
    assert backend.batch_set_v1(hashes, other) == [True, True]
    back = host.alloc(2 * PAGE_SIZE)
    assert backend.batch_get_v1(hashes, back) == [True, True]
    assert same(host, first, host, back) and not same(host, other, host, back)


def test_a_kv_only_registration_serves_v1_as_before(checkpoint, tmp_path):
    """Plain models register through v2 too (sglang's KV-only group): one KV pool."""
    group = hybrid_group(checkpoint, "gpt-oss", "page_first")
    kv = group.anchor_entry.host_pool
    backend = StorageBackendFactory.create_backend("dynamic", config(kvtier_config(f"file://{tmp_path}")), kv)
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.on_host_pools_registered()
    hashes = page_keys(tokens(3))
    slots = kv.alloc(3 * PAGE_SIZE)
    assert backend.batch_set_v1(hashes, slots) == [True] * 3
    assert backend.batch_exists(hashes) == 3
    assert backend.batch_exists_v2(hashes, []).kv_hit_pages == 3
    # a sliding pool that was never registered serves nothing: never a hit
    assert backend.batch_exists_v2(hashes, [trailing()]).kv_hit_pages == 0
    assert backend.batch_get_v2([trailing(host_indices=slots[:8], keys=hashes[:2])]) == {"swa": [False, False]}


class _MambaLikePool:
    """A state pool (no K/V heads): what kvtier cannot read in place."""

    layout, page_size, size = "page_first", PAGE_SIZE, 64


def test_an_unsupported_pool_fails_at_registration_naming_it(checkpoint, tmp_path):
    group = hybrid_group(checkpoint, "mimo", "page_first")
    backend = attach(group, f"file://{tmp_path}")
    with pytest.raises(UnsupportedPoolError, match="host pool 'mamba' .*_MambaLikePool"):
        backend.register_mem_host_pool_v2(_MambaLikePool(), PoolName.MAMBA)


def test_an_unsupported_hit_policy_fails_at_its_first_call_naming_it(checkpoint, tmp_path):
    group = hybrid_group(checkpoint, "mimo", "page_first")
    backend = attach(group, f"file://{tmp_path}")
    blocks = PoolTransfer(name=PoolName.SWA, keys=["x"], hit_policy=PoolHitPolicy.BLOCK_GROUPS)
    with pytest.raises(UnsupportedPoolError, match="block_groups"):
        backend.batch_exists_v2(page_keys(tokens(2)), [blocks])


def test_io_failures_answer_false_and_never_raise(checkpoint, tmp_path, monkeypatch):
    """sglang writes SWA before KV; a raise there would drop the KV write too."""
    group = hybrid_group(checkpoint, "mimo", "page_first")
    backend = attach(group, f"file://{tmp_path}")
    swa = backend.binding("swa")

    def broken(*args, **kwargs):
        raise OSError("disk went away")

    monkeypatch.setattr(swa.store, "batch_set", broken)
    monkeypatch.setattr(swa.store, "batch_get", broken)
    slots = pools(group)[PoolName.SWA].alloc(WINDOW * PAGE_SIZE)
    hashes = page_keys(tokens(2))
    assert backend.batch_set_v2([trailing(host_indices=slots, keys=hashes)]) == {"swa": [False, False]}
    assert backend.batch_get_v2([trailing(host_indices=slots, keys=hashes)]) == {"swa": [False, False]}
    wrong = backend.batch_set_v2([trailing(host_indices=slots[:3], keys=hashes)])  # indices of another length
    assert wrong == {"swa": [False, False]}
    counts = backend.stats()["pools"]["swa"]
    assert (counts["backup_failures"], counts["prefetch_misses"], counts["backup_pages"]) == (4, 2, 0)


def test_sglang_file_backend_stores_mimo_pages_through_kvtiers_host_pools(checkpoint, tmp_path):
    """With kvtier's host pools (install_host_pool), sglang's own HiCacheFile moves
    both MiMo pools' pages through their flat pages, which sglang's asymmetric pool
    refuses."""
    from kvtier.integrations.sglang import install_host_pool
    from kvtier.integrations.sglang.install import uninstall_host_pool

    install_host_pool()
    try:
        writer = hybrid_group(checkpoint, "mimo", "page_first", seed=4)
        reader = hybrid_group(checkpoint, "mimo", "page_first", seed=5)
    finally:
        uninstall_host_pool()
    assert type(pools(writer)[PoolName.SWA]).__name__ == "KVTierMHAHostPool"

    def backend(group):
        store = HiCacheFile(config({}), file_path=str(tmp_path / "hicache"))
        for entry in group.entries:
            store.register_mem_host_pool_v2(entry.host_pool, entry.name)
        return store

    hashes = page_keys(tokens(3))
    moved = {}
    for name in (PoolName.KV, PoolName.SWA):
        src = pools(writer)[name].alloc(3 * PAGE_SIZE)
        dst = pools(reader)[name].alloc(3 * PAGE_SIZE)
        transfer = lambda slots: PoolTransfer(name=name, host_indices=slots, keys=hashes)  # noqa: E731
        assert backend(writer).batch_set_v2([transfer(src)]) == {name: [True] * 3}
        assert backend(reader).batch_get_v2([transfer(dst)]) == {name: [True] * 3}
        moved[name] = (src, dst)
    for name, (src, dst) in moved.items():
        assert same(pools(writer)[name], src, pools(reader)[name], dst)


@pytest.mark.parametrize("reader_tp", [1, 4])
def test_pages_of_both_pools_written_at_tp2_are_read_at_tp1_and_tp4(checkpoint, reader_tp, tmp_path):
    """MiMo in small with twice the heads (KV 4, SWA 8): each rank of TP 2 writes its
    heads of both pools; each rank of TP 1 or 4 reads its own heads of both."""
    url = f"file://{tmp_path}"
    hashes = page_keys(tokens(4))
    writers = []
    for rank in range(2):
        group = hybrid_group(checkpoint, "mimo", "page_first", seed=20 + rank, tp_size=2, heads=2)
        writers.append((group, *backup(attach(group, url, rank, 2), group, hashes)))
    for rank in range(reader_tp):
        group = hybrid_group(checkpoint, "mimo", "page_first_direct", seed=30 + rank, tp_size=reader_tp, heads=2)
        result, kv, swa, ok = restore(attach(group, url, rank, reader_tp), group, hashes)
        assert (result.kv_hit_pages, ok) == (4, [True, True])
        for name, slots in ((PoolName.KV, kv), (PoolName.SWA, swa)):
            mine = pools(group)[name]
            per_reader = mine.head_num
            for w, (wgroup, kv_w, swa_w) in enumerate(writers):
                theirs, src = pools(wgroup)[name], (kv_w if name == PoolName.KV else swa_w)
                per_writer = theirs.head_num
                lo, hi = w * per_writer, (w + 1) * per_writer  # the writer's global heads
                mlo, mhi = rank * per_reader, (rank + 1) * per_reader  # the reader's
                if max(lo, mlo) >= min(hi, mhi):
                    continue
                a, b = max(lo, mlo), min(hi, mhi)
                assert all(torch.equal(
                    bits(token_major(mine, n)[slots][:, :, a - mlo:b - mlo]),
                    bits(token_major(theirs, n)[src][:, :, a - lo:b - lo])) for n in ("k", "v")), (name, w, rank)


def test_a_draft_swa_sidecar_with_indices_from_kv_round_trips(checkpoint, tmp_path):
    """MTP's DRAFT_SWA pool: ALL_PAGES, its host indices the KV pool's (the controller
    resolves them before the call); registered like the others, kept apart."""
    url = f"file://{tmp_path}"
    group = hybrid_group(checkpoint, "gpt-oss", "page_first", seed=6)
    _, draft = mha_pools("page_first", head_num=2, head_dim=16, v_head_dim=16)
    fill_random(draft, 9)
    backend = attach(group, url)
    backend.register_mem_host_pool_v2(draft, PoolName.DRAFT_SWA)
    hashes = page_keys(tokens(3))
    kv_slots = pools(group)[PoolName.KV].alloc(3 * PAGE_SIZE)
    sidecar = PoolTransfer(name=PoolName.DRAFT_SWA, host_indices=kv_slots, keys=hashes,
                           hit_policy=PoolHitPolicy.ALL_PAGES, indices_from_pool=PoolName.KV)
    assert backend.batch_set_v2([sidecar]) == {"draft_swa": [True] * 3}
    assert backend.batch_set_v1(hashes, kv_slots) == [True] * 3
    check = PoolTransfer(name=PoolName.DRAFT_SWA, keys=hashes, hit_policy=PoolHitPolicy.ALL_PAGES)
    assert backend.batch_exists_v2(hashes, [check]).restorable_prefix_pages == [1, 2, 3]
    _, other = mha_pools("page_first", head_num=2, head_dim=16, v_head_dim=16)
    fresh = attach(hybrid_group(checkpoint, "gpt-oss", "page_first", seed=7), url)
    fresh.register_mem_host_pool_v2(other, PoolName.DRAFT_SWA)
    into = other.alloc(3 * PAGE_SIZE)
    got = fresh.batch_get_v2([PoolTransfer(name=PoolName.DRAFT_SWA, host_indices=into, keys=hashes)])
    assert got == {"draft_swa": [True] * 3}
    assert same(draft, kv_slots, other, into)


def test_full_layer_pages_written_beyond_the_head_count_are_a_clean_miss_elsewhere(checkpoint, tmp_path):
    """TP 8 on MiMo's 4 full-layer KV heads: sglang gives each rank one head, shared by
    two ranks. Those pages read back at TP 8; at TP 4 (one head each, none shared) they
    are a clean miss, never another rank's or another geometry's heads."""
    url = f"file://{tmp_path}"
    hashes = page_keys(tokens(2))
    written = []
    for rank in range(8):
        group = hybrid_group(checkpoint, "mimo", "page_first", seed=40 + rank, tp_size=8, heads=2)
        assert pools(group)[PoolName.KV].head_num == 1
        written.append((group, *backup(attach(group, url, rank, 8), group, hashes)))
    again = hybrid_group(checkpoint, "mimo", "page_first", seed=50, tp_size=8, heads=2)
    result, kv, swa, ok = restore(attach(again, url, 3, 8), again, hashes)
    assert (result.kv_hit_pages, ok) == (2, [True, True])
    assert same(pools(written[3][0])[PoolName.KV], written[3][1], pools(again)[PoolName.KV], kv)
    assert same(pools(written[3][0])[PoolName.SWA], written[3][2], pools(again)[PoolName.SWA], swa)
    other = hybrid_group(checkpoint, "mimo", "page_first", seed=51, tp_size=4, heads=2)
    assert attach(other, url, 1, 4).batch_exists_v2(hashes, [trailing()]).kv_hit_pages == 0
