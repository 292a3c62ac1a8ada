"""The reuse rule's arithmetic (``kvtier.cache.sides``) against its definition, page by page."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.cache.sides import resumable, runs


def brute_resumable(windows: dict[str, int], held: dict[str, set[int]], limit: int, page_size: int) -> int:
    """The largest ``p <= limit`` whose every window (pages ``[max(0, p*ps - W) // ps, p)``) is held."""
    for p in range(limit, 0, -1):
        if all(all(i in held[g] for i in range(max(0, p * page_size - w) // page_size, p))
               for g, w in windows.items()):
            return p
    return 0


def test_runs_count_the_consecutive_indices_ending_at_each():
    assert runs([5, 1, 2, 3, 7, 2]) == {1: 1, 2: 2, 3: 3, 5: 1, 7: 1}
    assert runs([]) == {}


def test_resumable_finds_the_last_point_whose_windows_are_held():
    # window of 2 pages (page size 4, 8 tokens): p = 6 needs pages 4 and 5
    held = {"swa": runs([0, 1, 4, 5, 9])}
    assert resumable({"swa": 8}, held, 10, 4) == 6   # p = 10 needs 8, 9: 8 is missing
    assert resumable({"swa": 8}, held, 5, 4) == 2    # past the limit's pages: not tried
    assert resumable({"swa": 8}, {"swa": runs([])}, 10, 4) == 0
    # a window that does not end on a page boundary reaches one page further back
    assert resumable({"swa": 6}, {"swa": runs([3, 4])}, 5, 4) == 5
    assert resumable({"swa": 6}, {"swa": runs([4])}, 5, 4) == 0


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c"]),
                       st.tuples(st.integers(1, 40), st.sets(st.integers(0, 24), max_size=20)), min_size=1),
       st.integers(0, 26), st.sampled_from([1, 2, 3, 4, 16]))
def test_resumable_matches_its_definition(groups, limit, page_size):
    windows = {g: w for g, (w, _) in groups.items()}
    held = {g: pages for g, (_, pages) in groups.items()}
    got = resumable(windows, {g: runs(list(pages)) for g, pages in held.items()}, limit, page_size)
    assert got == brute_resumable(windows, held, limit, page_size)
