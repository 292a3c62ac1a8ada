"""Hybrid models in storage: objects per (group, page), lookups that never report a
prefix some group cannot restore, and bytes that come back exactly."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
import torch

import kvtier.storage
from kvtier import HybridHostPool, HybridSpec
from kvtier.storage.groups import GroupedStorage, group_tag
from tests.support.pools import HYBRID_SPECS, SPECS, bits, fill_random

PAGE = 4


def filled(spec, pages, layout="page_first", seed=0):
    host = HybridHostPool(spec, pages * PAGE, PAGE, layout=layout)
    gen = torch.Generator().manual_seed(seed)
    for _, pool in host:
        for buf in pool.buffers.values():
            fill_random(buf, gen)
    return host


def slots(pages):
    return torch.tensor([p * PAGE + s for p in pages for s in range(PAGE)], dtype=torch.int64)


def keys_for(n, namespace="hybrid-model"):
    return kvtier.storage.page_keys(list(range(n * PAGE)), PAGE, namespace=namespace)


def window_of(spec, group, pages):
    """The pages of ``group``'s window before ``pages`` whole pages."""
    return list(spec.group(group).attention.needed_pages(pages * PAGE, PAGE))


@pytest.mark.parametrize("layouts", [("page_first", "page_head"), ("layer_first", "page_first_direct")])
@pytest.mark.parametrize("spec_name", list(HYBRID_SPECS))
def test_each_groups_pages_round_trip_exactly(open_store, spec_name, layouts):
    spec = HYBRID_SPECS[spec_name]
    store = GroupedStorage(open_store(), spec, PAGE)
    src, dst = filled(spec, 6, layouts[0], seed=1), filled(spec, 6, layouts[1], seed=2)
    keys = keys_for(6)
    sliding = {g.name: window_of(spec, g.name, 6) for g in spec.groups if not g.attention.is_full}
    pages = {g.name: sliding.get(g.name, list(range(6))) for g in spec.groups}
    ok = store.batch_set(keys, src, {n: slots(p) for n, p in pages.items()}, pages)
    assert ok == {n: [True] * len(p) for n, p in pages.items()}
    if open_store.zero_copy:
        dst = filled(spec, 6, layouts[0], seed=2)  # raw objects: read in the writer's layout
    back = {n: list(reversed(p)) for n, p in pages.items()}  # into other pages
    got = store.batch_get(keys, dst, {n: slots(sorted(range(6))[:len(p)]) for n, p in back.items()}, back)
    assert got == {n: [True] * len(p) for n, p in back.items()}
    for name, pool in dst:
        for i, page in enumerate(back[name]):
            want = src[name].get_data_page(page * PAGE, flat=True)
            assert torch.equal(bits(pool.get_data_page(i * PAGE, flat=True)), bits(want)), (name, page)
    assert store.reusable(keys) == 6


def test_groups_of_one_geometry_never_read_each_other(open_store):
    spec = HYBRID_SPECS["oss"]  # full and sliding groups share one KVSpec
    assert spec.group("full").spec == spec.group("swa").spec
    store = GroupedStorage(open_store(), spec, PAGE)
    src, keys = filled(spec, 2, seed=3), keys_for(2)
    store.batch_set(keys, src, {"full": slots([0, 1])}, {"full": [0, 1]})
    assert store.present(keys) == {"full": [True, True], "swa": [False, False]}
    assert store.batch_get(keys, filled(spec, 2), {"swa": slots([0])}, {"swa": [0]}) == {"swa": [False]}
    assert store.reusable(keys) == 0  # the window of page 2 is missing


def test_a_missing_page_of_any_group_ends_the_hit_before_it(open_store):
    spec = HYBRID_SPECS["mimo"]  # window 6 tokens: pages [p*4-6, p*4) lie in the last 2 pages
    store = GroupedStorage(open_store(), spec, PAGE)
    src, keys = filled(spec, 8, seed=4), keys_for(8)
    store.batch_set(keys, src, {"full": slots(range(8)), "swa": slots([2, 3, 6, 7])},
                    {"full": list(range(8)), "swa": [2, 3, 6, 7]})  # windows of resume points 4 and 8
    assert store.reusable(keys) == 8
    assert store.reusable(keys[:7]) == 4  # page 5 (window of 7) was never stored: back to resume point 4
    assert store.reusable(keys[:5]) == 4
    assert store.reusable(keys[:3]) == 0  # page 1 is missing for a resume after 3 pages; page 0 for after 1
    store.storage.delete(store.keys("full", [keys[5]]))  # a full page in the middle
    assert store.reusable(keys) == 4
    store.storage.delete(store.keys("swa", [keys[2]]))   # a sliding page of the remaining window
    assert store.reusable(keys) == 0


def test_pages_held_in_other_tiers_count_for_their_group_only(open_store):
    spec = HYBRID_SPECS["mimo"]
    store = GroupedStorage(open_store(), spec, PAGE)
    src, keys = filled(spec, 6, seed=5), keys_for(6)
    store.batch_set(keys, src, {"full": slots([4, 5]), "swa": slots([4])}, {"full": [4, 5], "swa": [4]})
    held = {"full": [True] * 4, "swa": [False, False, False, False, True, False]}
    assert store.reusable(keys, held) == 0  # swa page 5 is nowhere, and a resume after 4 needs swa pages 2, 3
    held["swa"][2:4] = [True, True]
    assert store.reusable(keys, held) == 5  # swa pages 3 (held) and 4 (stored) cover a resume after 5
    held["swa"][5] = True
    assert store.reusable(keys, held) == 6
    assert store.reusable(keys, {"full": [True] * 6, "swa": [True] * 6}) == 6
    assert store.reusable(keys, {"swa": [True] * 6}) == 0  # the full pages 0-3 are nowhere


def test_a_uniform_spec_keeps_its_plain_keys(open_store):
    spec = SPECS["asym"]
    assert group_tag(HybridSpec.of(spec), "kv") == ""
    raw = open_store()
    store = GroupedStorage(raw, spec, PAGE)
    src, keys = filled(spec, 3, seed=6), keys_for(3)
    store.batch_set(keys, src, {"kv": slots([0, 1, 2])})
    assert raw.batch_exists(keys) == 3 and store.reusable(keys) == 3


def test_shards_name_the_full_models_groups(open_store):
    spec = HYBRID_SPECS["mimo"]
    full, shard = GroupedStorage(open_store(), spec, PAGE), GroupedStorage(open_store(), spec.shard(1, 2), PAGE)
    assert full.keys("swa", ["ns/ab"]) == shard.keys("swa", ["ns/ab"]) != full.keys("full", ["ns/ab"])


def test_bad_calls_raise_before_any_io(open_store):
    spec = HYBRID_SPECS["mimo"]
    raw = open_store()
    store = GroupedStorage(raw, spec, PAGE)
    src, keys = filled(spec, 2), keys_for(2)
    with pytest.raises(ValueError, match=r"host_indices\['swa'\] must hold 2 pages of 4 slots, got 4"):
        store.batch_set(keys, src, {"full": slots([0, 1]), "swa": slots([0])})  # the full group moves nothing
    with pytest.raises(ValueError, match=r"unknown group 'nope'"):
        store.present(keys, {"nope": [0]})
    with pytest.raises(ValueError, match=r"pages\['full'\] holds \[2\]"):
        store.present(keys, {"full": [2]})
    with pytest.raises(ValueError, match=r"pages\['full'\] holds \[2\]"):
        store.present(keys, {"full": range(3)})  # a range too: every page in range
    assert store.present(keys, {"full": range(2), "swa": range(1, 2)}) == {"full": [False, False], "swa": [False]}
    for bad in (-1, True, 1.0, np.int64(1)):  # only plain ints in range name pages
        with pytest.raises(ValueError, match=r"pages\['swa'\] holds \["):
            store.present(keys, {"full": [0, 1], "swa": [0, bad]})
    with pytest.raises(ValueError, match="HybridHostPool of spec"):
        store.batch_get(keys, filled(HYBRID_SPECS["oss"], 2), {"full": slots([0, 1])}, {"full": [0, 1]})
    assert raw.batch_exists(store.keys("full", keys)) == 0


def test_a_later_groups_bad_slots_are_refused_before_any_group_moves(open_store):
    """Slots out of the pool, or a read's page named twice, in the second group raise
    ``ValueError`` naming that group before the first group's files are written or its
    host pages filled (before, the first group's call had run)."""
    spec = HYBRID_SPECS["mimo"]
    raw = open_store()
    store = GroupedStorage(raw, spec, PAGE)
    src, keys = filled(spec, 2), keys_for(2)
    with pytest.raises(ValueError, match=r"group 'swa': host_indices has slots in \[0, 399\]"):
        store.batch_set(keys, src, {"full": slots([0, 1]), "swa": slots([0, 99])})
    assert raw.batch_exists(store.keys("full", keys)) == 0
    assert store.batch_set(keys, src, {"full": slots([0, 1]), "swa": slots([0, 1])}) == {"full": [True, True],
                                                                                          "swa": [True, True]}
    dst = filled(spec, 2, seed=5)
    before = {(name, c): bits(buf).clone() for name, pool in dst for c, buf in pool.buffers.items()}
    with pytest.raises(ValueError, match=r"group 'swa': host_indices names the same page more than once"):
        store.batch_get(keys, dst, {"full": slots([0, 1]), "swa": slots([1, 1])})
    assert all(torch.equal(bits(buf), before[name, c]) for name, pool in dst for c, buf in pool.buffers.items())


class _Broken:
    """A backend whose every answer is a fault or nonsense."""

    def __init__(self, mode):
        self.mode = mode

    def batch_exists(self, keys):
        if self.mode == "raise":
            raise ConnectionError("down")
        return "yes"

    def exists_each(self, keys):
        if self.mode == "raise":
            raise ConnectionError("down")
        return [True]  # the wrong length


@pytest.mark.parametrize("mode", ["raise", "nonsense"])
def test_a_faulty_backend_is_a_miss_never_an_exception(mode):
    spec = HYBRID_SPECS["mimo"]
    store, keys = GroupedStorage(_Broken(mode), spec, PAGE), keys_for(4)
    assert store.present(keys) == {"full": [False] * 4, "swa": [False] * 4}
    assert store.reusable(keys) == 0
    assert store.reusable(keys, {"full": [True] * 4}) == 0       # the sliding window is nowhere
    assert store.reusable(keys, {"full": [True] * 4, "swa": [True] * 4}) == 4
    with pytest.raises(ValueError, match=r"held names groups \['sw'\]"):
        store.reusable(keys, {"sw": [True]})


class _AskedStore:
    """An in-memory store (kvtier's simulated one) that records the keys each lookup asks."""

    def __init__(self) -> None:
        from kvtier.sim.store import SimStorage

        self.inner, self.asked = SimStorage(), []

    def batch_exists(self, keys):
        self.asked += list(keys)
        return self.inner.batch_exists(keys)

    def exists_each(self, keys):
        self.asked += list(keys)
        return self.inner.exists_each(keys)


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(["mimo", "oss", "all_swa", "long_window"]), n=st.integers(0, 12),
       stored=st.sets(st.tuples(st.integers(0, 1), st.integers(0, 11))),
       held=st.sets(st.tuples(st.integers(0, 1), st.integers(0, 11))))
def test_reusable_is_the_rule_over_what_storage_and_the_tiers_hold(name, n, stored, held):
    spec = HYBRID_SPECS[name]
    names = spec.names
    store = _AskedStore()
    grouped = GroupedStorage(store, spec, PAGE)
    keys = keys_for(n)
    for g, i in stored:
        if g < len(names) and i < n:
            store.inner.batch_set(grouped.keys(names[g], [keys[i]]), None, None)
    tiers = {g: [(k, i) in held for i in range(n)] for k, g in enumerate(names)}
    present = {g: [tiers[g][i] or store.inner.exists_each(grouped.keys(g, [keys[i]]))[0] for i in range(n)]
               for g in names}
    assert grouped.reusable(keys, tiers) == spec.reusable_pages(PAGE, present)
    if all(tiers[g] == sorted(tiers[g], reverse=True) for g in names if spec.group(g).attention.is_full):
        assert len(store.asked) == len(set(store.asked))  # the cache's case: no key is asked twice
