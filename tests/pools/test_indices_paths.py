"""page_starts checks small inputs in plain Python and large ones in numpy, or in the
compiled loop (``kvtier.pools._indices``) where it is built: all must accept exactly
what a slot-by-slot reference accepts and word every error the same. Without the
compiled module its own tests are skipped, or fail under KVTIER_REQUIRE_SERVICES=1 (CI)."""

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.compiled import built, load
from kvtier.pools import indices
from kvtier.pools.indices import page_slots, page_starts, page_token_slots
from tests.support.memory import capsule_tensor, left_after
from tests.support.services import unavailable


@pytest.fixture
def compiled():
    """The compiled module ``kvtier.pools._indices``."""
    module = load(indices.COMPILED)
    if module is None:
        unavailable("kvtier.pools._indices is not built (no C compiler at install time?) or KVTIER_NATIVE=0")
    return module


def reference(slots: list[int], page_size: int, size: int, unique: bool) -> list[int] | None:
    """Page numbers, or ``None`` when any slot breaks a rule: one slot at a time."""
    if len(slots) % page_size:
        return None
    pages = []
    for i in range(0, len(slots), page_size):
        first = slots[i]
        if first % page_size:
            return None
        for j in range(page_size):
            if slots[i + j] != first + j or not 0 <= slots[i + j] < size:
                return None
        pages.append(first // page_size)
    if unique and len(set(pages)) != len(pages):
        return None
    return pages


def outcome(slots, dtype, page_size, size, unique, small_slots, monkeypatch, native=False):
    """``("ok", pages)`` or ``("error", message)``; ``native``: the compiled loop, else numpy."""
    monkeypatch.setattr(indices, "_SMALL_SLOTS", small_slots)
    monkeypatch.setenv("KVTIER_NATIVE", "1" if native else "0")
    try:
        got = page_starts(torch.tensor(slots, dtype=dtype), page_size=page_size, size=size, what="idx", unique=unique)
    except ValueError as e:
        return "error", str(e)
    assert got.dtype == torch.int64 and got.device.type == "cpu"
    return "ok", got.tolist()


@st.composite
def slot_lists(draw):
    """Whole pages, sometimes broken: a slot changed, swapped, out of range, repeated."""
    page_size = draw(st.sampled_from([1, 2, 3, 4, 12, 16]))  # 3 and 12: the compiled loop's division path
    num_pages = draw(st.integers(1, 12))
    pages = draw(st.lists(st.integers(-1, num_pages), max_size=10))
    slots = [p * page_size + j for p in pages for j in range(page_size)]
    if slots and draw(st.booleans()):
        k = draw(st.integers(0, len(slots) - 1))
        slots[k] = draw(st.sampled_from([slots[k] + 1, slots[k] - 1, -slots[k] - 1, num_pages * page_size]))
    if len(slots) > 1 and draw(st.booleans()):
        k = draw(st.integers(0, len(slots) - 2))
        slots[k], slots[k + 1] = slots[k + 1], slots[k]
    if draw(st.booleans()):
        slots = slots[:draw(st.integers(0, len(slots)))]
    return slots, page_size, num_pages * page_size


@settings(max_examples=400, deadline=None)
@given(case=slot_lists(), unique=st.booleans(), dtype=st.sampled_from([torch.int64, torch.int32]))
def test_small_numpy_and_compiled_paths_agree_with_the_reference(case, unique, dtype):
    slots, page_size, size = case
    native = load(indices.COMPILED) is not None
    with pytest.MonkeyPatch.context() as mp:
        small = outcome(slots, dtype, page_size, size, unique, 10**9, mp)
        large = outcome(slots, dtype, page_size, size, unique, 0, mp)
        if native:
            assert outcome(slots, dtype, page_size, size, unique, 0, mp, native) == large
    assert small == large
    want = reference(slots, page_size, size, unique)
    assert small == ("ok", want) if want is not None else small[0] == "error"


@pytest.mark.parametrize("small_slots, compiled_loop", [(0, False), (10**9, False), (0, True)])
def test_errors_name_the_first_bad_page(small_slots, compiled_loop, monkeypatch, request):
    monkeypatch.setattr(indices, "_SMALL_SLOTS", small_slots)
    if not compiled_loop:
        monkeypatch.setenv("KVTIER_NATIVE", "0")
    else:
        request.getfixturevalue("compiled")
    cases = [([0, 1, 2, 3, 6, 7, 8, 9], "idx: page 1 starts at slot 6, not a multiple of page_size 4"),
             ([0, 1, 2, 3, 4, 5, 7, 7], "idx: page 1 slots [4, 5, 7, 7] are not consecutive from 4"),
             ([12, 13, 14, 15, 16, 17, 18, 19], "idx has slots in [12, 19], outside the pool's [0, 16)"),
             ([-4, -3, -2, -1], "idx has slots in [-4, -1], outside the pool's [0, 16)"),
             ([4, 5, 6, 7, 4, 5, 6, 7], "idx names the same page more than once")]
    for slots, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            page_starts(torch.tensor(slots), page_size=4, size=16, what="idx", unique=True)


@pytest.mark.parametrize("small_slots, compiled_loop", [(0, False), (10**9, False), (0, True)])
def test_errors_name_the_first_bad_page_of_a_page_size_not_a_power_of_two(small_slots, compiled_loop, monkeypatch,
                                                                          request):
    """The compiled loop divides for such page sizes (a mask and a shift for the others)."""
    monkeypatch.setattr(indices, "_SMALL_SLOTS", small_slots)
    if not compiled_loop:
        monkeypatch.setenv("KVTIER_NATIVE", "0")
    else:
        request.getfixturevalue("compiled")
    cases = [([0, 1, 2, 4, 5, 6], "idx: page 1 starts at slot 4, not a multiple of page_size 3"),
             ([3, 4, 5, 1, 2, 3], "idx: page 1 starts at slot 1, not a multiple of page_size 3"),
             ([0, 1, 2, 3, 4, 6], "idx: page 1 slots [3, 4, 6] are not consecutive from 3"),
             ([9, 10, 11, 12, 13, 14], "idx has slots in [9, 14], outside the pool's [0, 13)"),
             ([6, 7, 8, 6, 7, 8], "idx names the same page more than once")]
    for slots, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            page_starts(torch.tensor(slots), page_size=3, size=13, what="idx", unique=True)
    assert page_starts(torch.tensor([9, 10, 11, 0, 1, 2]), page_size=3, size=13, what="idx").tolist() == [3, 0]


@pytest.mark.parametrize("page_size, slots", [
    (2, [2**63 - 2, 2**63 - 1]),
    (4, [2**63 - 4, 2**63 - 3, 2**63 - 2, 2**63 - 1]),
    (3, [2**63 - 2, 2**63 - 1, -2**63]),  # consecutive only if the sum wraps past 2^63
    (3, [-2**63, -2**63 + 1, -2**63 + 2]),
])
def test_slots_at_the_ends_of_int64_are_refused_alike_by_every_path(page_size, slots, monkeypatch, compiled):
    """The compiled loop compares a page's slots before its range check, so a start
    near 2^63 must wrap (unsigned), never overflow: the same error as numpy's."""
    messages = []
    for native in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(indices, "_SMALL_SLOTS", 0)
            mp.setenv("KVTIER_NATIVE", native)
            with pytest.raises(ValueError) as e:
                page_starts(torch.tensor(slots), page_size=page_size, size=16, what="idx")
            messages.append(str(e.value))
    assert messages[0] == messages[1]


def test_a_partial_last_page_is_outside_a_pool_of_partial_size():
    """``size`` need not be a multiple of ``page_size``: a page must fit whole."""
    for small_slots in (0, 10**9):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(indices, "_SMALL_SLOTS", small_slots)
            assert page_starts(torch.arange(8, 12), page_size=4, size=14, what="x").tolist() == [2]
            with pytest.raises(ValueError, match="outside"):
                page_starts(torch.arange(12, 16), page_size=4, size=14, what="x")


def test_large_inputs_and_views():
    page_size, pages = 64, 4096
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(0))
    idx = page_slots(order, page_size)
    assert torch.equal(idx, (order[:, None] * page_size + torch.arange(page_size)).reshape(-1))
    assert torch.equal(page_starts(idx, page_size=page_size, size=pages * page_size, what="x", unique=True), order)
    tail = idx[10 * page_size:]  # a view past its storage's start: the compiled check reads from its own address
    assert torch.equal(page_starts(tail, page_size=page_size, size=pages * page_size, what="x"), order[10:])
    strided = torch.stack([idx, torch.zeros_like(idx)], 1)[:, 0]  # a non-contiguous view
    assert torch.equal(page_starts(strided, page_size=page_size, size=pages * page_size, what="x"), order)
    assert torch.equal(page_starts(idx.to(torch.int32), page_size=page_size, size=pages * page_size, what="x"), order)
    broken = idx.clone()
    broken[1000 * page_size + 7] += 1
    with pytest.raises(ValueError, match="page 1000 slots"):
        page_starts(broken, page_size=page_size, size=pages * page_size, what="x")
    assert page_starts(torch.empty(0, dtype=torch.int32), page_size=4, size=16, what="x").dtype == torch.int64


def test_page_slots_takes_int32_and_empty():
    assert page_slots(torch.tensor([2, 0], dtype=torch.int32), 3).tolist() == [6, 7, 8, 0, 1, 2]
    out = page_slots(torch.empty(0, dtype=torch.int64), 4)
    assert out.dtype == torch.int64 and out.numel() == 0
    assert np.array_equal(page_slots(torch.tensor([5]), 1).numpy(), [5])


def test_compiled_loops_equal_numpy_on_large_inputs(compiled, monkeypatch):
    rng = np.random.default_rng(5)
    for page_size in (1, 2, 16, 64):
        pages = rng.permutation(20_000)[:5000].astype(np.int64)
        expanded = page_token_slots(pages, page_size)
        size = 20_000 * page_size
        assert page_starts(torch.from_numpy(expanded), page_size=page_size, size=size, what="x",
                           unique=True).tolist() == pages.tolist()
        with monkeypatch.context() as mp:
            mp.setenv("KVTIER_NATIVE", "0")
            assert np.array_equal(page_token_slots(pages, page_size), expanded)
        for k in rng.integers(0, expanded.size, 20):  # one slot off: the same page named by both paths
            broken = expanded.copy()
            broken[k] += int(rng.choice([-1, 1, page_size, 10**12]))
            outcomes = [outcome(broken.tolist(), torch.int64, page_size, size, True, 0, monkeypatch, native)
                        for native in (True, False)]
            assert outcomes[0] == outcomes[1]
            assert outcomes[0][0] == "error" or page_size == 1  # one slot of a page moved breaks the page


class _Slots(torch.Tensor):
    """A tensor subclass: it may answer its attributes its own way, so the check reads it
    through its numpy view, not at its address."""


def test_the_check_in_place_takes_only_plain_contiguous_cpu_int64_tensors(compiled, monkeypatch):
    calls = []
    real = compiled.check_pages_at
    monkeypatch.setattr(indices, "load", lambda name: type("M", (), {
        "check_pages_at": staticmethod(lambda *a: calls.append(a) or real(*a)),
        "check_pages": staticmethod(compiled.check_pages)})())
    idx = torch.arange(64, 96)
    want = [4, 5]
    inputs = {"plain": (idx, True), "offset view": (torch.arange(96)[64:], True),
              "int32": (idx.to(torch.int32), False), "subclass": (idx.as_subclass(_Slots), False),
              "non-contiguous": (torch.stack([idx, idx], 1)[:, 0], False), "2-D": (idx.reshape(2, 16), False),
              "negative view": (torch._neg_view(idx), False)}  # its memory holds 64..95, its values -64..-95
    for name, (slots, in_place) in inputs.items():
        calls.clear()
        if name == "2-D":
            with pytest.raises(ValueError, match="1-D"):
                page_starts(slots, page_size=16, size=128, what="x")
        elif name == "negative view":  # its values, never its memory's pages
            with pytest.raises(ValueError, match=r"slots in \[-95, -64\], outside the pool's \[0, 128\)"):
                page_starts(slots, page_size=16, size=128, what="x")
        else:
            assert page_starts(slots, page_size=16, size=128, what="x", unique=True).tolist() == want, name
        assert bool(calls) == in_place, name
    calls.clear()
    with pytest.raises(ValueError, match="page 1 starts at slot 81"):  # refused in place, worded by the numpy path
        page_starts(torch.cat([idx[:16], idx[:16] + 17]), page_size=16, size=128, what="x")
    assert len(calls) == 1


def test_check_pages_at_reads_the_slots_at_an_address(compiled):
    slots, out = np.arange(8, 16, dtype=np.int64), np.empty(2, dtype=np.int64)
    address = slots.ctypes.data
    assert compiled.check_pages_at(address, 8, 4, 16, out, True) == -1 and out.tolist() == [2, 3]
    assert compiled.check_pages_at(address + 32, 4, 4, 16, out[:1]) == -1 and out[0] == 3
    assert compiled.check_pages_at(address, 8, 4, 12, out) == 1  # page 3 does not fit whole
    twice = np.array([4, 5, 6, 7, 4, 5, 6, 7], dtype=np.int64)
    assert compiled.check_pages_at(twice.ctypes.data, 8, 4, 8, out, True) == -2
    with pytest.raises(ValueError, match="need an output of 2 pages, got 3"):
        compiled.check_pages_at(address, 8, 4, 16, np.empty(3, dtype=np.int64))
    for count in (0, -8, 6):
        with pytest.raises(ValueError, match="need an output"):
            compiled.check_pages_at(address, count, 4, 16, out)
    for bad in (0, address + 4):
        with pytest.raises(ValueError, match="not that of int64s"):
            compiled.check_pages_at(bad, 8, 4, 16, out)
    with pytest.raises(TypeError, match="int64"):
        compiled.check_pages_at(address, 8, 4, 16, np.empty(2, dtype=np.float64))


def test_compiled_loops_check_their_buffers(compiled):
    slots, out = np.arange(8, dtype=np.int64), np.empty(2, dtype=np.int64)
    assert compiled.check_pages(slots, 4, 8, out) == -1 and out.tolist() == [0, 1]
    assert compiled.check_pages(slots, 4, 7, out) == 1  # page 1 does not fit whole
    assert compiled.check_pages(-slots - 1, 4, 8, out) == 0
    twice = np.array([4, 5, 6, 7, 4, 5, 6, 7], dtype=np.int64)
    assert compiled.check_pages(twice, 4, 8, out) == -1 and out.tolist() == [1, 1]
    assert compiled.check_pages(twice, 4, 8, out, True) == -2
    many = np.random.default_rng(1).permutation(10_000)
    assert compiled.check_pages(many, 1, 10_000, np.empty(10_000, dtype=np.int64), True) == -1
    many[9_999] = many[17]
    assert compiled.check_pages(many, 1, 10_000, np.empty(10_000, dtype=np.int64), True) == -2
    with pytest.raises(ValueError, match="need an output of 2 pages, got 3"):
        compiled.check_pages(slots, 4, 8, np.empty(3, dtype=np.int64))
    with pytest.raises(ValueError, match="need an output"):
        compiled.check_pages(slots[:6], 4, 8, out)
    with pytest.raises(ValueError, match="positive"):
        compiled.check_pages(slots, 0, 8, out)
    with pytest.raises(TypeError, match="int64"):
        compiled.check_pages(slots.astype(np.int32), 4, 8, out)
    with pytest.raises(TypeError, match="int64"):
        compiled.check_pages(slots, 4, 8, np.empty(2, dtype=np.float64))
    with pytest.raises((TypeError, ValueError)):  # read-only output
        compiled.check_pages(slots, 4, 8, np.frombuffer(bytes(16), dtype=np.int64))
    with pytest.raises((TypeError, ValueError)):  # not contiguous
        compiled.check_pages(np.arange(16, dtype=np.int64)[::2], 4, 8, out)
    got = np.empty(6, dtype=np.int64)
    compiled.expand_pages(np.array([2, 0], dtype=np.int64), 3, got)
    assert got.tolist() == [6, 7, 8, 0, 1, 2]
    with pytest.raises(ValueError, match="need 6, the output holds 5"):
        compiled.expand_pages(np.array([2, 0], dtype=np.int64), 3, np.empty(5, dtype=np.int64))
    # a page size whose product with the pages wraps (4 * 2^62 is 0 in 64 bits) is no
    # empty output's match: refused, where it wrote 2^62 slots past the output
    for expand, pages in ((compiled.expand_pages, np.arange(4, dtype=np.int64)),
                          (compiled.expand_runs, [np.arange(4, dtype=np.int64)])):
        with pytest.raises(ValueError, match="need more than 2\\^63, the output holds 0"):
            expand(pages, 2 ** 62, np.empty(0, dtype=np.int64))


@pytest.mark.parametrize("page_size", [*range(1, 10), 15, 16, 17, 32, 63, 64, 65, 128])
def test_every_expansion_equals_numpy_at_every_page_size(page_size):
    """The compiled expansions (four slots a store where the CPU has wide stores and the
    page size is a multiple of four, else a vector loop with a tail) write exactly
    numpy's slots, at page sizes that fill whole vectors and ones that leave a tail;
    window_slots leaves a hole's page at -1."""
    compiled = load(indices.COMPILED)
    if compiled is None:
        pytest.skip("the compiled indices module is not built")
    rng = np.random.default_rng(page_size)
    pages = rng.permutation(1 << 20)[:37].astype(np.int64)
    want = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)
    for expand, pages_in in ((compiled.expand_pages, pages), (compiled.expand_runs, [pages[:5], pages[5:]])):
        got = np.full(want.size, -7, dtype=np.int64)
        expand(pages_in, page_size, got)
        assert np.array_equal(got, want)
    held = pages.copy()
    held[[0, 9, 36]] = -1
    got = np.full(want.size + 2 * page_size, -7, dtype=np.int64)
    assert compiled.window_slots([(2, held)], page_size, got) == 34
    assert np.array_equal(got[2 * page_size:], np.where(np.repeat(held < 0, page_size), -1, want))
    assert (got[:2 * page_size] == -1).all()


def test_expand_runs_writes_each_run_after_the_last_and_checks_all_first():
    compiled = load(indices.COMPILED)
    if compiled is None:
        pytest.skip("the compiled indices module is not built")
    runs = [np.array([5, 1], dtype=np.int64), np.array([], dtype=np.int64), np.array([9], dtype=np.int64)]
    got = np.full(9, -1, dtype=np.int64)
    compiled.expand_runs(runs, 3, got)
    assert got.tolist() == [15, 16, 17, 3, 4, 5, 27, 28, 29]
    assert got.tolist() == page_token_slots(np.concatenate(runs), 3).tolist()
    compiled.expand_runs((), 3, np.empty(0, dtype=np.int64))
    for bad_runs, out, error in (
            (runs, np.full(8, -1, dtype=np.int64), ValueError),  # one slot short
            ([runs[0], runs[2].astype(np.int32)], np.full(9, -1, dtype=np.int64), TypeError),  # a run of int32
            ([runs[0], np.arange(4, dtype=np.int64)[::2]], np.full(12, -1, dtype=np.int64), ValueError),  # strided
            (7, np.full(6, -1, dtype=np.int64), TypeError)):  # not a sequence of runs
        with pytest.raises(error):
            compiled.expand_runs(bad_runs, 3, out)
        assert (out == -1).all()  # nothing written before the check
    with pytest.raises(ValueError, match="positive"):
        compiled.expand_runs(runs, 0, got)


def test_window_slots_fills_holes_and_expands_each_piece_after_checking_them_all_and_counts_its_pages():
    compiled = load(indices.COMPILED)
    if compiled is None:
        pytest.skip("the compiled indices module is not built")
    got = np.zeros(12, dtype=np.int64)
    written = compiled.window_slots([(1, np.array([7, -1], dtype=np.int64)), (3, np.array([0], dtype=np.int64))], 3,
                                    got)
    assert got.tolist() == [-1, -1, -1, 21, 22, 23, -1, -1, -1, 0, 1, 2]
    assert written == 2  # the pages that were not holes
    assert compiled.window_slots([], 3, got) == 0
    assert got.tolist() == [-1] * 12
    for pieces, error in (([(3, np.array([1, 2], dtype=np.int64))], ValueError),  # past the end
                          ([(-1, np.array([1], dtype=np.int64))], ValueError),
                          ([(0, np.array([1], dtype=np.int32))], TypeError),
                          ([(0, np.array([1], dtype=np.int64)), [1, np.array([1], dtype=np.int64)]], TypeError),
                          ([(0, np.array([1], dtype=np.int64)), (1,)], TypeError),
                          (5, TypeError)):
        out = np.full(12, 9, dtype=np.int64)
        with pytest.raises(error):
            compiled.window_slots(pieces, 3, out)
        assert (out == 9).all()  # nothing written before every piece checked out
    with pytest.raises(ValueError, match="positive"):
        compiled.window_slots([], 0, got)


def test_expansions_given_a_count_write_new_slots_a_tensor_takes_once(compiled):
    """With a count of slots for ``out``, each expansion writes what it writes into a
    buffer, in new memory handed back as a DLPack capsule (window_slots: with its page
    count); a count that does not fit is refused the same way; the memory goes with the
    capsule or the tensor made of it, once."""
    import gc

    pages = np.array([7, 2, 5], dtype=np.int64)
    runs = [np.array([5, 1], dtype=np.int64), np.array([], dtype=np.int64), np.array([9], dtype=np.int64)]
    pieces = [(1, np.array([7, -1], dtype=np.int64)), (3, np.array([0], dtype=np.int64))]
    assert capsule_tensor(compiled.expand_pages(pages, 4, 12)).tolist() == page_token_slots(pages, 4).tolist()
    assert capsule_tensor(compiled.expand_runs(runs, 3, 9)).tolist() == [15, 16, 17, 3, 4, 5, 27, 28, 29]
    assert capsule_tensor(compiled.expand_runs((), 3, 0)).tolist() == []
    capsule, written = compiled.window_slots(pieces, 3, 12)
    assert capsule_tensor(capsule).tolist() == [-1, -1, -1, 21, 22, 23, -1, -1, -1, 0, 1, 2] and written == 2
    for call in (lambda: compiled.expand_pages(pages, 4, 11), lambda: compiled.expand_runs(runs, 3, 10),
                 lambda: compiled.window_slots(pieces, 3, 9), lambda: compiled.expand_pages(pages, 4, -12),
                 lambda: compiled.expand_runs(runs, 3, 1 << 58)):  # checked before its memory is asked for
        with pytest.raises(ValueError):
            call()
    with pytest.raises(TypeError):
        compiled.expand_runs([runs[0], runs[2].astype(np.int32)], 3, 9)
    made = capsule_tensor(compiled.expand_pages(np.arange(512, dtype=np.int64), 16, 8192))
    gc.collect()
    assert made[::16].tolist() == list(range(0, 8192, 16))  # outlives its capsule

    def calls():
        compiled.expand_pages(np.arange(512, dtype=np.int64), 16, 8192)  # dropped unread
        assert capsule_tensor(compiled.expand_runs([np.arange(512, dtype=np.int64)], 16, 8192))[17].item() == 17
        compiled.window_slots(pieces, 3, 12)
        with pytest.raises(ValueError):
            compiled.expand_runs(runs, 3, 8192)  # refused, nothing made

    left = left_after(calls, 100)
    assert left < 8192 * 8, left  # less than one call's slots (300 calls' would be 20 MB)


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "numpy"])
def test_page_token_slots_writes_into_a_stretch_of_a_larger_array(native, monkeypatch):
    """With ``out``, the slots land in that stretch (and nowhere else) on both paths; an
    ``out`` of another size, dtype or a strided one is refused before anything is written."""
    if not native:
        monkeypatch.setenv("KVTIER_NATIVE", "0")
    pages = np.array([7, 2, 5], dtype=np.int64)
    for page_size in (1, 4):
        whole = np.full(20, -1, dtype=np.int64)
        got = page_token_slots(pages, page_size, out=whole[3:3 + 3 * page_size])
        assert got.base is whole or got.base is whole.base
        want = page_token_slots(pages, page_size).tolist()
        assert whole.tolist() == [-1] * 3 + want + [-1] * (17 - 3 * page_size)
    for bad in (np.zeros(11, dtype=np.int64), np.zeros(12, dtype=np.int32), np.zeros(24, dtype=np.int64)[::2]):
        before = bad.copy()
        with pytest.raises(ValueError, match=r"out must be a contiguous \(12,\) int64 array"):
            page_token_slots(pages, 4, out=bad)
        assert np.array_equal(bad, before)


@settings(max_examples=150, deadline=None)
@given(pages=st.lists(st.integers(-3, 70) | st.sampled_from([-2**63, 2**62, 2**63 - 1]), min_size=1, max_size=40),
       native=st.booleans())
def test_distinct_pages_equals_its_definition(pages, native):
    """The free of many pages checks them in one compiled pass (``check_pages`` of one-slot
    pages), which answers as a set would; switched off, it leaves them to the caller."""
    want = all(0 <= p < 64 for p in pages) and len(set(pages)) == len(pages)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVTIER_NATIVE", "1" if native else "0")
        got = indices.distinct_pages(np.array(pages, dtype=np.int64), 64)
    assert got is None if not native or built(indices.COMPILED) is None else got == want


@settings(max_examples=200, deadline=None)
@given(flags=st.lists(st.booleans(), min_size=1, max_size=40), data=st.data())
def test_first_flagged_equals_its_definition(flags, data):
    """The compiled pass and numpy's both answer the first index from ``start`` whose
    page's flag is ``value``."""
    pages = data.draw(st.lists(st.integers(0, len(flags) - 1), max_size=30))
    start, value = data.draw(st.integers(0, len(pages))), data.draw(st.booleans())
    want = next((i for i in range(start, len(pages)) if flags[pages[i]] == value), -1)
    flag_array, page_array = np.array(flags, dtype=bool), np.array(pages, dtype=np.int64)
    for native in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KVTIER_NATIVE", native)
            assert indices.first_flagged(flag_array, page_array, start, value) == want


@settings(max_examples=200, deadline=None)
@given(flags=st.lists(st.booleans(), max_size=20), data=st.data())
def test_first_flagged_refuses_pages_outside_its_flags_alike(flags, data):
    """A page outside the flags before the first hit is a ``ValueError`` naming it, on
    both paths (numpy's indexing would wrap a negative page and raise ``IndexError`` for
    a large one); a bad start too. Pages after the hit are not read."""
    n = len(flags)
    pages = data.draw(st.lists(st.integers(-3, n + 2), max_size=20))
    start, value = data.draw(st.integers(-1, len(pages) + 1)), data.draw(st.booleans())
    want, error = -1, None
    if not 0 <= start <= len(pages):
        error = f"start {start} outside the {len(pages)} pages"
    else:
        for i in range(start, len(pages)):
            if not 0 <= pages[i] < n:
                error = rf"page {pages[i]} \(item {i}\) outside the {n} flags"
                break
            if flags[pages[i]] == value:
                want = i
                break
    flag_array, page_array = np.array(flags, dtype=bool), np.array(pages, dtype=np.int64)
    for native in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KVTIER_NATIVE", native)
            if error is None:
                assert indices.first_flagged(flag_array, page_array, start, value) == want
            else:
                with pytest.raises(ValueError, match=error):
                    indices.first_flagged(flag_array, page_array, start, value)


def test_first_flag_checks_its_pages_and_buffers(compiled):
    flags, pages = np.array([False, True, False]), np.array([0, 2, 1], dtype=np.int64)
    assert compiled.first_flag(flags, pages, 0, True) == 2 and compiled.first_flag(flags, pages, 0, False) == 0
    assert compiled.first_flag(flags, pages, 3, True) == -1
    with pytest.raises(ValueError, match=r"page 3 \(item 1\) outside the 3 flags"):
        compiled.first_flag(flags, np.array([0, 3, 1], dtype=np.int64), 0, True)
    with pytest.raises(ValueError, match=r"page -1 \(item 0\) outside"):
        compiled.first_flag(flags, np.array([-1], dtype=np.int64), 0, True)
    assert compiled.first_flag(flags, np.array([1, 3], dtype=np.int64), 0, True) == 0  # stops before the bad one
    for start in (-1, 4):
        with pytest.raises(ValueError, match=f"start {start} outside the 3 pages"):
            compiled.first_flag(flags, pages, start, True)
    with pytest.raises(TypeError, match="a byte a page"):
        compiled.first_flag(flags.astype(np.int64), pages, 0, True)
    with pytest.raises(TypeError, match="int64"):
        compiled.first_flag(flags, pages.astype(np.int32), 0, True)
