"""``LoadHandle``: each layer waits for its own arrival (or the load's end), across
threads, after the loads it depends on; a finished handle waits for nothing."""

import threading

import pytest
import torch

from array import array
from dataclasses import FrozenInstanceError, fields

from kvtier.cache.handles import LoadHandle, MatchResult


def handle(layers=4, depends=()):
    return LoadHandle(torch.arange(8), layers, depends)


def test_a_layer_is_ready_once_it_arrived_and_not_before():
    h = handle()
    assert not h.wait_layer(0, timeout=0.01) and not h.done()
    h._layer_done(1)
    assert h.wait_layer(1, timeout=0) and not h.wait_layer(0, timeout=0.01) and not h.wait(timeout=0.01)
    for layer in (0, 2, 3):
        h._layer_done(layer)
    assert h.wait(timeout=0) and h.done() and h.error is None  # every layer arrived: done without _finish


def test_a_waiter_on_another_thread_wakes_for_its_layer():
    """Waiting without a timeout: a waiter that is never woken is still alive after
    the join's 30 s (a daemon, so that the test fails rather than hangs)."""
    h, woke = handle(), []
    waiter = threading.Thread(target=lambda: woke.append(h.wait_layer(2)), daemon=True)
    waiter.start()
    h._layer_done(0)  # another layer: the waiter sleeps on
    waiter.join(0.05)
    assert waiter.is_alive() and not woke
    h._layer_done(2)
    waiter.join(30)
    assert not waiter.is_alive() and woke == [True]


def test_finishing_releases_every_layer_with_its_error():
    h, woke = handle(), []
    waiters = [threading.Thread(target=lambda i=i: woke.append(h.wait_layer(i)), daemon=True) for i in range(4)]
    for w in waiters:
        w.start()
    failure = RuntimeError("disk gone")
    h._finish(failure)
    for w in waiters:
        w.join(30)
    assert not any(w.is_alive() for w in waiters)
    assert woke == [True] * 4 and h.done() and h.error is failure


def test_a_layer_waits_for_the_loads_it_depends_on():
    first = handle()
    h = handle(depends=(first,))
    h._finish()
    assert not h.wait_layer(0, timeout=0.01) and not h.wait(timeout=0.01) and not h.done()
    first._layer_done(0)
    assert h.wait_layer(0, timeout=0) and not h.done()
    first._finish(RuntimeError("its pages failed"))
    assert h.done() and isinstance(h.error, RuntimeError)


def test_a_finished_handle_with_nothing_to_wait_on_is_waited_at_once():
    h = handle(layers=61)
    h._finish()
    assert h.wait(timeout=0) and h.done()
    h.wait_layer = lambda layer, timeout=None: pytest.fail(f"a finished handle asked layer {layer}")
    assert h.wait()


def test_a_handle_made_finished_answers_as_one_finished_after():
    """``finished=True`` (a device hit's, a commit's handle) waits for nothing, and for
    the loads it depends on as any finished handle does."""
    first = handle()
    made = LoadHandle(torch.arange(8), 4, (first,), finished=True)
    after = handle(depends=(first,))
    after._finish()
    for h in (made, after):
        assert not h.wait_layer(0, timeout=0.01) and not h.done() and h.error is None
    first._finish(RuntimeError("its pages failed"))
    for h in (made, after):
        assert h.wait(timeout=0) and h.done() and isinstance(h.error, RuntimeError)
    alone = LoadHandle(torch.arange(8), 4, finished=True)
    assert alone.wait(timeout=0) and alone.wait_layer(3, timeout=0) and alone.done() and alone.error is None
    with pytest.raises(IndexError):
        alone.wait_layer(4)


def test_a_layer_outside_the_handle_is_an_index_error_even_when_finished():
    h = handle()
    h._finish()
    with pytest.raises(IndexError):
        h.wait_layer(4)
    assert h.wait_layer(-1)  # Python's negative index, as a list of events took it


def test_the_caches_own_match_result_is_the_one_init_makes():
    """``MatchResult.made`` (the cache's constructor, every field given) sets each field as
    ``__init__`` does (the same objects), is not peeked and stays frozen."""
    args = (torch.arange(8), 8, 4, 0, object(), ("a", "b"), array("q", range(12)), b"t")
    groups = {"swa": torch.full((8,), -1)}
    made = MatchResult.made(*args, groups)
    init = MatchResult(*args, groups=groups)
    assert [getattr(made, f.name) is getattr(init, f.name) or getattr(made, f.name) == getattr(init, f.name)
            for f in fields(MatchResult)] == [True] * len(fields(MatchResult))
    assert made.peeked is False and made.cached_len == 12 and made.groups is groups
    with pytest.raises(FrozenInstanceError):
        made.device_len = 0
