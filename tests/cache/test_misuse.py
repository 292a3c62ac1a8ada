"""Caller mistakes: a clear ValueError before anything changes, never corrupt state."""

import numpy as np
import pytest
import torch

import kvtier.storage
from tests.support.cache_engine import check_prefix, compute, make_cache, serve

A = list(range(100, 112))            # 3 pages
B = list(range(200, 208))            # 2 pages


def hits(m):
    return (m.device_len, m.host_len, m.storage_len)


def snapshot(cache):
    cache.flush()
    return sorted((tuple(n.key), n.lock_ref, n.dev_pages is not None, n.host_ready) for n in cache.tree.nodes())


def test_a_second_release_raises_and_keeps_the_other_holders_lock():
    cache = make_cache()
    serve(cache, A)
    holder = cache.acquire(A)
    careless = cache.acquire(A)
    cache.release(careless)
    with pytest.raises(ValueError, match="already released"):
        cache.release(careless)
    assert cache.evict_device(64) == 0 and cache.evict_host(64) == 0   # holder's pages stay
    check_prefix(cache, A, holder.device_indices)
    cache.release(holder)
    assert cache.evict_device(64) == 12


def test_an_acquisition_is_released_only_by_its_own_cache():
    cache, other = make_cache(), make_cache()
    serve(cache, A)
    got = cache.acquire(A)
    with pytest.raises(ValueError, match="another cache"):
        other.release(got)
    assert cache.evict_device(64) == 0                        # still held
    cache.release(got)
    assert cache.evict_device(64) == 12


def test_unlock_takes_the_lease_and_releases_it_exactly_once():
    cache, other = make_cache(), make_cache()
    serve(cache, A)
    serve(other, A)
    m = cache.match_prefix(A)
    before = snapshot(cache)
    first, second = cache.lock(m), cache.lock(m)               # one lease per lock
    assert first is not second and not first.released
    with pytest.raises(ValueError, match="not the MatchResult"):
        cache.unlock(m)
    with pytest.raises(ValueError, match="got str"):
        cache.unlock("not a lease")
    with pytest.raises(ValueError, match="unlock: this lease comes from another cache"):
        other.unlock(first)
    cache.unlock(first)
    assert first.released and not second.released
    with pytest.raises(ValueError, match="unlock: this lease was already released"):
        cache.unlock(first)
    assert cache.evict_device(64) == 0                        # the second lock still holds
    cache.unlock(second)
    assert snapshot(cache) == before
    with pytest.raises(ValueError, match="another cache"):
        make_cache().lock(m)


def test_a_refused_unlock_changes_no_count():
    cache, other = make_cache(), make_cache()
    serve(cache, A)
    lease = cache.lock(cache.match_prefix(A))
    held = snapshot(cache)
    for bad in (cache.match_prefix(A), other.lock(other.match_prefix(A)), None):
        with pytest.raises(ValueError):
            cache.unlock(bad)
        assert snapshot(cache) == held
    cache.unlock(lease)
    assert cache.evict_device(64) == 12


def test_locked_yields_the_match_and_unlocks_on_error():
    cache = make_cache()
    serve(cache, A)
    m = cache.match_prefix(A)
    with pytest.raises(KeyError):
        with cache.locked(m) as got:
            assert got is m
            assert cache.evict_device(64) == 0
            raise KeyError("the request failed")
    assert cache.evict_device(64) == 12


def test_an_acquired_lease_is_released_once_whichever_call_releases_it():
    cache = make_cache()
    serve(cache, A)
    got = cache.acquire(A)
    cache.unlock(got.lease)
    assert got.released
    with pytest.raises(ValueError, match="release: this Acquired was already released"):
        cache.release(got)
    assert cache.evict_device(64) == 12


def test_insert_rejects_slots_of_another_cached_prefix():
    cache = make_cache()
    serve(cache, A)
    theirs = cache.match_prefix(A).device_indices[:8]
    before = snapshot(cache)
    with pytest.raises(ValueError, match="already holds another cached page"):
        cache.insert(B, theirs.clone())
    assert snapshot(cache) == before and hits(cache.match_prefix(B)) == (0, 0, 0)
    with pytest.raises(ValueError, match="holds a cached page"):
        cache.free_device(theirs)                             # nor may the caller free them
    check_prefix(cache, A, cache.match_prefix(A).device_indices)


@pytest.mark.parametrize("native", ["1", "0"])
def test_freeing_a_cached_page_names_its_first_slot_and_frees_nothing(native, monkeypatch):
    """A ``free_device`` of a page the caller owns, then pages a node holds: the error
    names the first held page's first slot, and the caller's page is still its own."""
    monkeypatch.setenv("KVTIER_NATIVE", native)
    cache = make_cache()
    serve(cache, A)
    theirs = cache.match_prefix(A).device_indices[4:12]
    mine = cache.alloc_device(4)
    with pytest.raises(ValueError, match=f"free_device: slot {int(theirs[0])} holds a cached page"):
        cache.free_device(torch.cat([mine, theirs]))
    cache.free_device(mine)  # freed once, here: the refused call freed nothing
    check_prefix(cache, A, cache.match_prefix(A).device_indices)


@pytest.mark.parametrize("native", ["1", "0"])
def test_insert_names_the_first_page_held_elsewhere_or_not_allocated(native, monkeypatch):
    """The path's own pages may come back for the prefix it holds; a page another node
    holds is named where it first appears, among those or after them, then a page the
    pool did not hand out. The compiled pass and numpy's agree."""
    monkeypatch.setenv("KVTIER_NATIVE", native)
    cache = make_cache()
    serve(cache, A)
    serve(cache, B)
    own, theirs = cache.match_prefix(A).device_indices, cache.match_prefix(B).device_indices
    longer = A + list(range(500, 508))  # A's 3 pages, then 2 new ones
    fresh = cache.alloc_device(8)
    before = snapshot(cache)
    cases = [(torch.cat([own[:4], theirs[:4], own[8:], fresh]), int(theirs[0]), 1),  # among the held pages
             (torch.cat([own, fresh[:4], theirs[4:]]), int(theirs[4]), 4),  # after them
             (torch.cat([theirs[4:], own[4:], fresh]), int(theirs[4]), 0)]
    for slots, slot, page in cases:
        with pytest.raises(ValueError, match=rf"device slot {slot} \(page {page} of the prompt\) already holds"):
            cache.insert(longer, slots)
    cache.free_device(fresh[4:])
    with pytest.raises(ValueError, match=f"device slot {int(fresh[4])} is not allocated"):
        cache.insert(longer, torch.cat([own, fresh]))
    assert snapshot(cache) == before
    again = cache.alloc_device(4)
    compute(cache, longer, torch.cat([own, fresh[:4], again]), 12)
    assert cache.insert(longer, torch.cat([own, fresh[:4], again])) == 12
    assert hits(cache.match_prefix(longer)) == (20, 0, 0)
    check_prefix(cache, longer, cache.match_prefix(longer).device_indices)


@pytest.mark.parametrize("slots, match", [
    (torch.arange(64, 72), r"outside the pool's \[0, 64\)"),
    (torch.arange(2, 10), "not a multiple of page_size"),
    (torch.arange(8).float(), "dtype int64 or int32"),
    (torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]), "same page more than once"),
    (torch.tensor([0, 1, 3, 2, 4, 5, 6, 7]), "not consecutive"),
])
def test_insert_checks_indices_before_the_tree_changes(slots, match):
    cache = make_cache()
    serve(cache, A)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=match):
        cache.insert(B, slots)
    assert snapshot(cache) == before and hits(cache.match_prefix(B)) == (0, 0, 0)


def test_insert_rejects_slots_that_were_never_allocated():
    cache = make_cache()
    with pytest.raises(ValueError, match="not allocated"):
        cache.insert(B, torch.arange(8))
    assert list(cache.tree.nodes()) == []


@pytest.mark.parametrize("bad, match", [
    ([100.5, 101, 102, 103], "element of type float"),
    ([100.0, 101, 102, 103], "element of type float"),
    (torch.arange(4).view(4, 1), r"shape \(4, 1\)"),
    (torch.arange(8).view(2, 4), r"shape \(2, 4\)"),
    (torch.tensor([1.0, 2.0, 3.0, 4.0]), "dtype torch.float32"),
    (np.array([1.5, 2, 3, 4]), "dtype float64"),
    ([[1, 2, 3, 4]], "element of type list"),
    ("abcd", "got str"),
    ([2 ** 64, 1, 2, 3], "int64 range"),
])
def test_token_ids_other_than_1d_ints_are_refused(tmp_path, bad, match):
    store = kvtier.storage.open(f"file://{tmp_path}")
    cache = make_cache(storage=store)
    slots = cache.alloc_device(4)
    for call in (lambda: cache.insert(bad, slots), lambda: cache.match_prefix(bad), lambda: cache.acquire(bad)):
        with pytest.raises(ValueError, match=match):
            call()
    cache.flush()
    assert list(cache.tree.nodes()) == [] and store.stats()["pages_written"] == 0
    cache.free_device(slots)
    cache.check_integrity(engine_device_slots=0)


def test_hf_shaped_token_ids_are_their_tokens():
    cache = make_cache()
    serve(cache, A)
    row = torch.tensor([A])                                   # (1, n), as Hugging Face input_ids
    assert hits(cache.match_prefix(row)) == (12, 0, 0)
    assert hits(cache.match_prefix(np.array(A, dtype=np.int32))) == (12, 0, 0)
    assert hits(cache.match_prefix(tuple(A))) == (12, 0, 0)
    assert hits(cache.match_prefix(iter(A))) == (12, 0, 0)


def test_salts_are_bytes_in_the_tree_and_in_storage(tmp_path):
    store = kvtier.storage.open(f"file://{tmp_path}")
    cache = make_cache(storage=store)
    for salt in (None, "t"):
        slots = cache.alloc_device(12)
        compute(cache, A, slots, 0)
        cache.insert(A, slots, salt=salt)
    cache.flush()
    for alias in (None, "", b""):
        assert hits(cache.match_prefix(A, salt=alias)) == (12, 0, 0)
    assert hits(cache.match_prefix(A, salt=b"t")) == (12, 0, 0)
    assert store.stats()["pages_written"] == 6                 # two tenants, three pages each
    fresh = make_cache(storage=store)
    for salt in (b"", "t", b"t"):
        assert hits(fresh.match_prefix(A, salt=salt)) == (0, 0, 12)
    assert hits(fresh.match_prefix(A, salt="u")) == (0, 0, 0)
    with pytest.raises(ValueError, match="salt must be"):
        cache.match_prefix(A, salt=3)


def test_freeing_a_slot_twice_is_the_callers_mistake():
    """A second ``free_device`` of the same slots is a ``UsageError`` (a ValueError), not a
    broken invariant, and changes nothing; slots another request holds stay allocated."""
    from kvtier.errors import UsageError

    cache = make_cache()
    mine, other = cache.alloc_device(8), cache.alloc_device(4)
    cache.free_device(mine)
    free = cache.device_pool.available_size()
    with pytest.raises(UsageError, match=f"slot {int(mine[0])} is not allocated"):
        cache.free_device(mine)
    with pytest.raises(UsageError, match=f"slot {int(mine[0])} is not allocated"):
        cache.free_device(torch.cat([other, mine[:4]]))  # one good page, one freed: nothing freed
    assert cache.device_pool.available_size() == free
    cache.free_device(other)
    assert cache.device_pool.available_size() == free + 4


def test_a_match_result_is_frozen_and_keeps_what_it_was_given():
    """Its own ``__init__`` (one dict update) keeps a dataclass's fields, defaults,
    equality and frozenness."""
    import dataclasses
    from array import array

    from kvtier.cache.handles import MatchResult

    slots = torch.arange(4)
    m = MatchResult(slots, 4, 2, 1, "node", ("node",), array("q", [1, 2]), b"t", groups={"g": slots})
    assert (m.device_indices is slots and m.cached_len == 6 and m.storage_len == 1 and m.last_node == "node"
            and m.path == ("node",) and m.tokens == array("q", [1, 2]) and m.salt == b"t" and not m.peeked
            and m.groups["g"] is slots)
    bare = MatchResult(slots, 4, 0, 0, None)
    assert bare.path == () and bare.tokens == array("q") and bare.salt == b"" and bare.groups is None
    assert bare.tokens is not MatchResult(slots, 4, 0, 0, None).tokens  # no shared default
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.device_len = 0
    assert [f.name for f in dataclasses.fields(MatchResult)] == list(vars(m))
    assert dataclasses.replace(m, peeked=True).peeked and "device_len=4" in repr(m)
