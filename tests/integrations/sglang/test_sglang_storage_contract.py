"""sglang's own unit tests of a HiCache storage backend, re-expressed for KVTierStorage.

sglang states its storage contract in ``test/registered/unit/mem_cache/
test_hicache_storage_unit.py`` and ``test_hicache_file_prefix.py`` (written against
``HiCacheFile``, with mock pools and file names). Here the same checks run against
kvtier's backend, built by sglang's ``StorageBackendFactory`` over real host pools
(``kv``, and ``swa``, ``draft_swa`` and ``dsa`` pools of the same shape registered
through v2), with pages written from and read into those pools: set/get/exists/clear,
the v1 batch wrappers, ``batch_exists_v2`` with its hit policies and the intersection
of restorable prefixes, and the v2 batch I/O. sglang's prefix tests use a Mamba state
pool as their second trailing pool and an indexer as the all-pages one; kvtier serves
neither kind (it refuses them at registration), so ``draft_swa`` and ``dsa`` stand in.
Checks of HiCacheFile's own file names have no kvtier counterpart; the unrelated-file
check stands for them.
"""

from unittest.mock import patch

import pytest

pytest.importorskip("sglang.srt")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageConfig, PoolHitPolicy, PoolName,  # noqa: E402
                                                  PoolTransfer, PoolTransferResult)
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from tests.support.sglang_rig import PAGE_SIZE, bits, fill_random, kvtier_config, mha_pools, token_major  # noqa: E402


def _config() -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="meta-llama/Llama-3.2-1B", extra_config=kvtier_config(""))


class Rig:
    """A kvtier backend over a KV host pool (the anchor) and two more pools of its shape."""

    def __init__(self, tmp_path, seed: int = 1) -> None:
        self.pools = {}
        for i, name in enumerate(("kv", "swa", "draft_swa", "dsa")):
            _, host = mha_pools("page_first", head_num=2, head_dim=16, v_head_dim=16)
            fill_random(host, seed * 10 + i)
            self.pools[name] = host
        config = _config()
        config.extra_config["url"] = f"file://{tmp_path}"
        self.storage = StorageBackendFactory.create_backend("dynamic", config, self.pools["kv"])
        self.storage.register_mem_pool_host(self.pools["kv"])
        for name, host in self.pools.items():
            self.storage.register_mem_host_pool_v2(host, PoolName(name) if name != "dsa" else name)
        self.storage.on_host_pools_registered()
        self.dir = tmp_path

    def slots(self, name: str, pages: int) -> torch.Tensor:
        return self.pools[name].alloc(pages * PAGE_SIZE)

    def write_kv(self, *keys: str) -> torch.Tensor:
        slots = self.slots("kv", len(keys))
        assert self.storage.batch_set_v1(list(keys), slots) == [True] * len(keys)
        return slots

    def write(self, name: str, *keys: str) -> torch.Tensor:
        slots = self.slots(name, len(keys))
        done = self.storage.batch_set_v2([PoolTransfer(name=name, host_indices=slots, keys=list(keys))])
        assert done == {name: [True] * len(keys)}
        return slots

    def page(self, i: int = 0) -> torch.Tensor:
        """A flat page of the KV pool (what sglang's generic path hands a backend)."""
        return self.pools["kv"].get_data_page(i * PAGE_SIZE, flat=True).clone()

    def same(self, name, a, b, other=None) -> bool:
        other = other or self.pools[name]
        return all(torch.equal(bits(token_major(self.pools[name], n)[a]), bits(token_major(other, n)[b]))
                   for n in ("k", "v"))


@pytest.fixture
def rig(tmp_path):
    return Rig(tmp_path)


def trailing(n: int, name="swa") -> PoolTransfer:
    return PoolTransfer(name=name, keys=[f"t{i}" for i in range(n)], hit_policy=PoolHitPolicy.TRAILING_PAGES)


def all_pages(keys, name="dsa") -> PoolTransfer:
    return PoolTransfer(name=name, keys=list(keys), hit_policy=PoolHitPolicy.ALL_PAGES)


# -- PoolTransferResult: sglang's own class, as the controller folds it ---------------------------
def test_pool_transfer_result_folds_as_the_controller_expects():
    r = PoolTransferResult.empty()
    assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (0, {})
    for n, want in ((5, 5), (3, 5), (8, 8)):
        r.update_kv_hit_pages(n)
        assert r.kv_hit_pages == want


# -- set / get / exists / clear (flat pages) --------------------------------------------------------
def test_exists_is_false_for_a_missing_key(rig):
    assert not rig.storage.exists("deadbeef_page_not_written")


def test_set_stores_and_exists_then_answers_true(rig):
    assert rig.storage.set("cafebabe_page_0001", rig.page(0))
    assert rig.storage.exists("cafebabe_page_0001")


def test_set_of_a_stored_key_keeps_the_first_value(rig):
    first, second = rig.page(0), rig.page(1)
    assert not torch.equal(bits(first), bits(second))
    assert rig.storage.set("cafebabe_page_idem", first)
    assert rig.storage.set("cafebabe_page_idem", second)
    back = torch.zeros_like(first)
    assert rig.storage.get("cafebabe_page_idem", back) is back
    assert torch.equal(bits(back), bits(first))


def test_get_of_a_missing_key_is_none(rig):
    assert rig.storage.get("deadbeef_page_not_written", torch.zeros_like(rig.page())) is None


def test_set_then_get_round_trips(rig):
    page = rig.page(2)
    assert rig.storage.set("cafebabe_page_roundtrip", page)
    back = torch.zeros_like(page)
    assert torch.equal(bits(rig.storage.get("cafebabe_page_roundtrip", back)), bits(page))


def test_clear_removes_every_page(rig):
    keys = [f"cafebabe_page_{i:03d}" for i in range(3)]
    for i, k in enumerate(keys):
        assert rig.storage.set(k, rig.page(i))
    rig.storage.clear()
    assert not any(rig.storage.exists(k) for k in keys)


def test_batch_exists_counts_the_leading_run(rig):
    assert rig.storage.batch_exists(["deadbeef_0", "deadbeef_1", "deadbeef_2"]) == 0
    rig.write_kv("p0", "p1")
    rig.write_kv("p3")  # p2 missing: the run stops there
    assert rig.storage.batch_exists(["p0", "p1", "p2", "p3"]) == 2
    rig.write_kv("p2")
    assert rig.storage.batch_exists(["p0", "p1", "p2", "p3"]) == 4


# -- batch_exists_v2 --------------------------------------------------------------------------------
def test_kv_only_hits_are_the_leading_run(rig):
    result = rig.storage.batch_exists_v2(["k0", "k1", "k2"])
    assert (result.kv_hit_pages, result.extra_pool_hit_pages) == (0, {})
    assert PoolName.KV not in result.extra_pool_hit_pages
    rig.write_kv("a0", "a1")
    assert rig.storage.batch_exists_v2(["a0", "a1", "a2", "a3"]).kv_hit_pages == 2  # a3 absent
    rig.write_kv("a3")
    assert rig.storage.batch_exists_v2(["a0", "a1", "a2", "a3"]).kv_hit_pages == 2  # a3 beyond the gap
    keys = [f"p{i}" for i in range(4)]
    rig.write_kv(*keys)
    assert rig.storage.batch_exists_v2(keys).kv_hit_pages == 4


def test_all_pages_pool_trims_to_its_own_leading_run_never_beyond_kv(rig):
    keys = [f"b{i}" for i in range(4)]
    rig.write_kv(*keys)
    rig.write("dsa", "b0", "b1")
    assert rig.storage.batch_exists_v2(keys, [all_pages(keys)]).kv_hit_pages == 2
    rig.write("dsa", "b2", "b3")
    assert rig.storage.batch_exists_v2(keys, [all_pages(keys)]).kv_hit_pages == 4
    short = [f"d{i}" for i in range(4)]
    rig.write_kv("d0", "d1")
    rig.write("dsa", *short)
    assert rig.storage.batch_exists_v2(short, [all_pages(short)]).kv_hit_pages == 2


def test_trailing_pages_need_only_the_window_before_the_hit(rig):
    keys = [f"e{i}" for i in range(4)]
    rig.write_kv(*keys)
    assert rig.storage.batch_exists_v2(keys, [trailing(2)]).kv_hit_pages == 0  # no sliding page at all
    rig.write("swa", "e2", "e3")
    assert rig.storage.batch_exists_v2(keys, [trailing(2)]).kv_hit_pages == 4
    tail_absent = [f"f{i}" for i in range(4)]
    rig.write_kv(*tail_absent)
    rig.write("swa", "f0", "f1")
    result = rig.storage.batch_exists_v2(tail_absent, [trailing(2)])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (2, [1, 2])  # windows [f0] and [f0, f1]


def test_no_kv_hit_is_no_hit_whatever_the_other_pools_hold(rig):
    rig.write("dsa", "g0")
    rig.write("swa", "g0", "g1")
    assert rig.storage.batch_exists_v2(["g0", "g1"], [all_pages(["g0", "g1"]), trailing(1)]).kv_hit_pages == 0
    empty = rig.storage.batch_exists_v2([])
    assert (empty.kv_hit_pages, empty.extra_pool_hit_pages) == (0, {})


def test_several_pools_restore_only_prefixes_every_pool_can_serve(rig):
    """sglang's test expects 3 here (the minimum of each pool's own boundary, an older
    rule): but 3 pages need the sliding window m1-m2 and m1 is missing, so no prefix is
    restorable in every pool; sglang's controller intersects the restorable sets."""
    keys = [f"m{i}" for i in range(4)]
    rig.write_kv(*keys)
    rig.write("dsa", "m0", "m1", "m2")
    rig.write("swa", "m2", "m3")
    result = rig.storage.batch_exists_v2(keys, [all_pages(keys), trailing(2)])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (0, [])
    assert result.extra_pool_hit_pages == {"kv": 4, "dsa": 3, "swa": 4}
    rig.write("swa", "m1")
    result = rig.storage.batch_exists_v2(keys, [all_pages(keys), trailing(2)])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (3, [3])


def test_unrelated_files_in_storage_are_never_hits(rig):
    rig.write_kv("r0")
    (rig.dir / "random_unrelated_file.bin").write_bytes(b"\0" * 16)
    (rig.dir / "kvtier-v5" / "zz").mkdir(parents=True, exist_ok=True)
    (rig.dir / "kvtier-v5" / "zz" / "junk").write_bytes(b"\1" * 64)
    assert rig.storage.batch_exists_v2(["r0"]).kv_hit_pages == 1
    assert rig.storage.batch_exists_v2(["missing_key"]).kv_hit_pages == 0


# -- the v1 batch wrappers (flat pages) ---------------------------------------------------------------
def test_batch_set_stores_every_page_and_batch_get_reads_them_back(rig):
    keys = ["cafebabe_bs0", "cafebabe_bs1", "cafebabe_bs2"]
    values = [rig.page(i) for i in range(3)]
    assert rig.storage.batch_set(keys, values) is True
    assert all(rig.storage.exists(k) for k in keys)
    back = rig.storage.batch_get(keys, [torch.zeros_like(v) for v in values])
    assert all(torch.equal(bits(b), bits(v)) for b, v in zip(back, values))


def test_batch_get_of_a_missing_key_is_none_for_it(rig):
    assert rig.storage.set("cafebabe_bg_ok", rig.page())
    got = rig.storage.batch_get(["cafebabe_bg_ok", "deadbeef_missing"], [torch.zeros_like(rig.page())] * 2)
    assert got[0] is not None and got[1] is None


def test_batch_set_is_false_when_a_write_fails(rig):
    with patch.object(rig.storage, "set", side_effect=[True, False]):
        assert rig.storage.batch_set(["cafebabe_fail0", "cafebabe_fail1"], [rig.page(), rig.page()]) is False


# -- the v2 batch I/O ----------------------------------------------------------------------------------
def test_batch_set_v2_stores_each_page_and_batch_get_v2_fills_the_given_slots(rig):
    keys = ["cafebabe_v2g0", "cafebabe_v2g1"]
    written = rig.write("kv", *keys)
    assert all(rig.storage.exists(k) for k in keys)
    into = rig.slots("kv", 2)  # other slots: the pages land where the indices say
    before = {n: token_major(rig.pools["kv"], n).clone() for n in ("k", "v")}
    got = rig.storage.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=into, keys=keys)])
    assert got == {"kv": [True, True]}
    assert rig.same("kv", written, into)
    untouched = [s for s in range(len(before["k"])) if s not in set(into.tolist())]
    assert all(torch.equal(bits(token_major(rig.pools["kv"], n)[untouched]), bits(before[n][untouched]))
               for n in ("k", "v"))


def test_batch_get_v2_of_a_missing_page_is_false_and_leaves_the_host_alone(rig):
    into = rig.slots("kv", 1)
    before = token_major(rig.pools["kv"], "k")[into].clone()
    got = rig.storage.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=into, keys=["deadbeef_v2missing"])])
    assert got == {"kv": [False]}
    assert torch.equal(bits(token_major(rig.pools["kv"], "k")[into]), bits(before))


@pytest.mark.parametrize("op", ["batch_set_v2", "batch_get_v2"])
def test_v2_io_with_host_indices_of_another_length_is_false_for_every_key(rig, op):
    short = rig.slots("kv", 1)[:1]
    transfer = PoolTransfer(name=PoolName.KV, host_indices=short, keys=["cafebabe_mm0", "cafebabe_mm1"])
    assert getattr(rig.storage, op)([transfer]) == {"kv": [False, False]}


def test_v2_transfers_of_several_pools_are_each_processed(rig):
    kv, swa = rig.slots("kv", 1), rig.slots("swa", 1)
    transfers = [PoolTransfer(name=PoolName.KV, host_indices=kv, keys=["cafebabe_multi_kv0"]),
                 PoolTransfer(name=PoolName.SWA, host_indices=swa, keys=["cafebabe_multi_mb0"])]
    assert rig.storage.batch_set_v2(transfers) == {"kv": [True], "swa": [True]}
    assert rig.storage.batch_exists_v2(["cafebabe_multi_kv0"]).kv_hit_pages == 1
    assert rig.storage.batch_exists_v2(["cafebabe_multi_mb0"]).kv_hit_pages == 0  # a SWA page is not a KV page


# -- test_hicache_file_prefix.py: restorable prefixes across pools ----------------------------------
PREFIX_CASES = {  # kv pages, [(pool, pages, policy, window)], restorable prefixes (pages are 1-based)
    "aligned checkpoints": ({1, 2, 3}, [("swa", {3}, "trailing", 1), ("draft_swa", {3}, "trailing", 1)], [3]),
    "disjoint checkpoints": ({1, 2, 3}, [("swa", {3}, "trailing", 1), ("draft_swa", {2}, "trailing", 1)], []),
    "non-contiguous stop points": ({1, 2, 3}, [("draft_swa", {1, 3}, "trailing", 1)], [1, 3]),
    "earlier common checkpoint": ({1, 2, 3}, [("swa", {1, 3}, "trailing", 1),
                                              ("draft_swa", {1, 2}, "trailing", 1)], [1]),
    "all pages truncates a trailing pool": ({1, 2, 3}, [("dsa", {1, 2}, "all", 3),
                                                        ("draft_swa", {1, 3}, "trailing", 1)], [1]),
    "multi-page window with holes": ({1, 2, 3, 4, 5}, [("swa", {1, 2, 4, 5}, "trailing", 2),
                                                       ("draft_swa", {2, 4}, "trailing", 1)], [2]),
    "prefix shorter than the window": ({1, 2}, [("swa", {1, 2}, "trailing", 3)], [1, 2]),
    "a kv hole limits the other pools": ({1, 3}, [("draft_swa", {3}, "trailing", 1)], []),
    "kv only": ({1, 3}, [], [1]),
    "nothing": (set(), [], []),
}


@pytest.mark.parametrize("reverse", [False, True], ids=["in order", "reversed"])
@pytest.mark.parametrize("case", sorted(PREFIX_CASES))
def test_restorable_prefixes_are_the_ones_every_pool_serves(case, reverse, tmp_path):
    kv_pages, pools, expected = PREFIX_CASES[case]
    rig = Rig(tmp_path)
    num_pages = max([*kv_pages, *(p for _, pages, _, _ in pools for p in pages), 3])
    keys = [f"page{i}" for i in range(1, num_pages + 1)]
    if kv_pages:
        rig.write_kv(*(keys[p - 1] for p in sorted(kv_pages)))
    for name, pages, _, _ in pools:
        rig.write(name, *(keys[p - 1] for p in sorted(pages)))
    policy = {"trailing": PoolHitPolicy.TRAILING_PAGES, "all": PoolHitPolicy.ALL_PAGES}
    transfers = [PoolTransfer(name=name, keys=keys[-window:], hit_policy=policy[kind])
                 for name, _, kind, window in pools]
    if reverse:
        transfers.reverse()
    for _ in range(2):  # a second query answers the same
        result = rig.storage.batch_exists_v2(keys, transfers)
        assert (result.kv_hit_pages, result.restorable_prefix_pages) == (max(expected, default=0), expected)
    assert rig.storage.batch_exists_v2([], transfers).restorable_prefix_pages == []
