"""Property tests of the page allocator against a set-of-pages reference model."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.errors import IntegrityError, UsageError
from kvtier.pools import PageAllocator


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.page_size = 4
        self.alloc = PageAllocator(12 * self.page_size, self.page_size)
        self.held: list[torch.Tensor] = []  # live allocations
        self.used: set[int] = set()  # reference model: allocated slots

    @rule(pages=st.integers(0, 14))
    def allocate(self, pages):
        free_before = self.alloc.available_size()
        got = self.alloc.alloc(pages * self.page_size)
        if pages * self.page_size > free_before:
            assert got is None
            assert self.alloc.available_size() == free_before
            return
        assert got is not None and got.numel() == pages * self.page_size
        slots = set(got.tolist())
        assert len(slots) == got.numel() and not (slots & self.used), "double allocation"
        assert all(int(s) % self.page_size == 0 for s in got[:: self.page_size])
        self.used |= slots
        self.held.append(got)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        got = self.held.pop(i % len(self.held))
        self.alloc.free(got)
        self.used -= set(got.tolist())

    @precondition(lambda self: self.held)
    @rule()
    def double_free_is_rejected(self):
        freed = self.held.pop()
        self.alloc.free(freed)
        self.used -= set(freed.tolist())
        before = self.alloc.available_size()
        if freed.numel():
            with pytest.raises(IntegrityError, match="not allocated"):
                self.alloc.free(freed)
        assert self.alloc.available_size() == before

    @invariant()
    def capacity_is_conserved(self):
        assert self.alloc.available_size() == 12 * self.page_size - len(self.used)


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@settings(max_examples=50, deadline=None)
@given(page_size=st.sampled_from([1, 2, 16]), pages=st.integers(1, 20))
def test_exhaustion_returns_none_and_free_restores(page_size, pages):
    a = PageAllocator(pages * page_size, page_size)
    got = a.alloc(pages * page_size)
    assert sorted(got.tolist()) == list(range(pages * page_size))
    assert a.alloc(page_size) is None
    a.free(got)
    assert a.available_size() == pages * page_size


@pytest.mark.parametrize("n, match", [(3, "multiple of page_size 4"), (-4, "non-negative"), (4.0, "int")])
def test_alloc_rejects_bad_counts(n, match):
    with pytest.raises(ValueError, match=match):
        PageAllocator(16, 4).alloc(n)


def test_free_rejects_partial_and_foreign_pages():
    a = PageAllocator(16, 4)
    got = a.alloc(8)
    with pytest.raises(UsageError, match="not a multiple"):
        a.free(got[:3])
    with pytest.raises(UsageError, match="outside"):
        a.free(torch.arange(16, 20))
    with pytest.raises(IntegrityError, match="not allocated"):
        a.free(torch.arange(8, 12))
    assert a.available_size() == 8


@pytest.mark.parametrize("size, page_size", [(10, 4), (0, 4), (16, 0), (16.0, 4)])
def test_sizes_are_checked_without_assert(size, page_size):
    with pytest.raises(UsageError):
        PageAllocator(size, page_size)


def test_exact_order_lowest_first_then_freed_order():
    a = PageAllocator(8 * 2, 2)
    assert a.alloc(4).tolist() == [0, 1, 2, 3]
    b = a.alloc(6)
    assert b.tolist() == [4, 5, 6, 7, 8, 9]
    a.free(torch.tensor([8, 9, 4, 5]))       # freed pages queue up behind the never-used ones
    assert a.alloc(8).tolist() == [10, 11, 12, 13, 14, 15, 8, 9]
    assert a.alloc(2).tolist() == [4, 5]
    assert a.alloc(2) is None
    a.free(torch.tensor([0, 1]))
    assert a.allocated(torch.tensor([0, 1, 2, 7])).tolist() == [False, True, True, True]
    assert a.allocated(np.array([7, 0], dtype=np.int64)).tolist() == [True, False]  # numpy page numbers too
    assert a.alloc(2).tolist() == [0, 1]


@settings(max_examples=80, deadline=None)
@given(page_size=st.sampled_from([1, 3]), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=60))
def test_order_matches_a_fifo_of_free_pages(page_size, ops):
    # replays (kvtier simulate) depend on which pages come back, not just how many
    pages = 10
    a = PageAllocator(pages * page_size, page_size)
    free, held = list(range(pages)), []
    for is_alloc, n in ops:
        if is_alloc:
            got = a.alloc(n * page_size)
            if n > len(free):
                assert got is None
                continue
            want, free = free[:n], free[n:]
            assert got.tolist() == [p * page_size + s for p in want for s in range(page_size)]
            held.append(got)
        elif held:
            got = held.pop(n % len(held))
            a.free(got)
            free += got[::page_size].div(page_size, rounding_mode="floor").tolist()
        assert a.available_size() == len(free) * page_size
        assert a.allocated(torch.arange(pages)).tolist() == [p not in free for p in range(pages)]


def test_pages_by_number_round_trip_and_refuse_double_frees():
    import numpy as np

    from kvtier.pools.allocator import PageAllocator

    a = PageAllocator(32, 4)
    pages = a.alloc_pages(3)
    assert pages.dtype == np.int64 and len(set(pages.tolist())) == 3 and a.available_size() == 20
    assert a.alloc_pages(6) is None and a.available_size() == 20
    a.free_pages(pages[:2])
    assert a.available_size() == 28
    with pytest.raises(IntegrityError, match="not allocated"):
        a.free_pages(pages[:1])
    with pytest.raises(UsageError, match=r"\[0, 8\)"):
        a.free_pages(np.array([8], dtype=np.int64))
    with pytest.raises(UsageError, match=r"\[0, 8\)"):
        a.free_pages(np.array([-1], dtype=np.int64))
    assert a.available_size() == 28
    a.free_pages(pages[2:].astype(np.int32))  # page numbers of another int dtype
    assert a.available_size() == 32 and not a.allocated(pages).any()


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("count", [1, 16, 17, 40])
def test_free_pages_refuses_a_page_out_of_range_among_many(count, native, monkeypatch):
    monkeypatch.setenv("KVTIER_NATIVE", native)  # many pages: the compiled check, or numpy's
    a = PageAllocator(64, 1)
    pages = a.alloc_pages(count)
    for bad in (-1, 64, -2**62):
        with pytest.raises(UsageError, match=r"\[0, 64\)"):
            a.free_pages(np.concatenate([pages[:-1], [bad]]))
        assert a.available_size() == 64 - count  # nothing was freed
    a.free_pages(pages)
    assert a.available_size() == 64



@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("count", [2, 16, 17, 40])
def test_free_pages_refuses_a_page_named_twice_and_alloc_pages_a_negative_count(count, native, monkeypatch):
    """A page named twice in one free would enter the free list twice, and be handed to
    two owners later; a negative count took pages off the ring's end and counted more
    free pages than the pool has. Both are refused before anything changes."""
    monkeypatch.setenv("KVTIER_NATIVE", native)
    a = PageAllocator(64, 1)
    pages = a.alloc_pages(count)
    with pytest.raises(UsageError, match="named twice"):
        a.free_pages(np.concatenate([pages[:-1], pages[:1]]))
    assert a.available_size() == 64 - count and a.allocated(pages).all()
    with pytest.raises(UsageError, match="alloc_pages must be a non-negative int, got -3"):
        a.alloc_pages(-3)
    assert a.available_size() == 64 - count
    a.free_pages(pages)
    assert sorted(a.alloc_pages(64).tolist()) == list(range(64))  # every page once

@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "release"]), st.integers(1, 40)), max_size=30))
def test_pages_by_number_against_a_set_model(ops):
    """alloc_pages / free_pages / release of few pages (a bytearray's flags) and of many
    (numpy's) keep one state: ``allocated`` and the free count agree with a set."""
    a, held, used = PageAllocator(64, 1), [], set()
    for op, k in ops:
        if op == "alloc":
            got = a.alloc_pages(k)
            if k > 64 - len(used):
                assert got is None
                continue
            assert len(set(got.tolist())) == k and not set(got.tolist()) & used
            used |= set(got.tolist())
            held.append(got)
        elif held:
            got = held.pop(k % len(held))
            (a.free_pages if op == "free" else a.release)(got)
            used -= set(got.tolist())
            with pytest.raises(IntegrityError, match="not allocated"):
                a.free_pages(got)  # a double free, refused whole
            if held and held[-1].size:  # a freed page among held ones: nothing is freed
                with pytest.raises(IntegrityError, match="not allocated"):
                    a.free_pages(np.concatenate([held[-1], got[:1]]))
        assert a.available_size() == 64 - len(used)
        assert set(np.flatnonzero(a.allocated(np.arange(64))).tolist()) == used
