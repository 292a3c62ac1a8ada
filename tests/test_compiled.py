"""kvtier.compiled: every compiled module is reached through ``load``, which reads
``KVTIER_NATIVE`` at each call, so the switch set after import (what a test's
``monkeypatch.setenv`` does) turns the token reader, the radix walk, the slot checks,
the CPU copy and the storage part loop to their pure paths at their next call, and
back. Where a module is not built the test is skipped, or fails under
KVTIER_REQUIRE_SERVICES=1 (CI)."""

from array import array

import numpy as np
import pytest
import torch

from kvtier import DeviceKVPool, HostKVPool, KVSpec, compiled
from kvtier.cache import tokens
from kvtier.cache.radix import RadixTree
from kvtier.pools import indices
from kvtier.storage import pageio
from kvtier.transfer import native
from tests.support.services import unavailable

#: each compiled module and the functions of it that kvtier calls
FUNCTIONS = {tokens.COMPILED: ("fill_int64", "walk_run"),
             indices.COMPILED: ("check_pages", "check_pages_at", "expand_pages", "first_flag"),
             native.COMPILED: ("copy_jobs",)}


@pytest.fixture
def calls(monkeypatch):
    """Names of the compiled functions called, recorded by a spy on each."""
    called = []
    for name, functions in FUNCTIONS.items():
        module = compiled.built(name)
        if module is None:
            unavailable(f"{name} is not built (no C compiler at install time?)")
        for function in functions:
            monkeypatch.setattr(module, function, _spy(getattr(module, function), function, called))
    return called


def _spy(fn, name, called):
    def spy(*args):
        called.append(name)
        return fn(*args)
    return spy


def _every_path() -> set[str]:
    """One call of each path that has a compiled twin; the twins' results must agree."""
    assert tokens.token_array([1, 2, 3]).tolist() == [1, 2, 3]
    tree = RadixTree(4)
    tree.add_child(tree.root(b""), array("q", [1, 2, 3, 4]))
    assert tree.walk(array("q", [1, 2, 3, 4]), b"")[1] == 4
    assert indices.page_token_slots(np.array([2, 0], dtype=np.int64), 4).tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
    many = torch.arange(indices._SMALL_SLOTS * 2)  # past the plain-Python size: numpy or the compiled loop
    assert indices.page_starts(many, page_size=4, size=4096, what="x").tolist() == list(range(many.numel() // 4))
    assert indices.first_flagged(np.array([True, False]), np.array([0, 1, 0], dtype=np.int64), 1, True) == 2
    # an int32 tensor has no int64 memory to check in place: its numpy copy is checked
    assert indices.page_starts(many.int(), page_size=4, size=4096, what="x").tolist() == list(range(many.numel() // 4))
    spec = KVSpec.mha(1, 1, 8)
    dev, host = DeviceKVPool(spec, 8, 4), HostKVPool(spec, 8, 4)
    dev.buffer("k", 0).fill_(3)
    host.backup_from_device_all_layer(dev, torch.arange(4), torch.arange(4, 8))
    assert host.buffers["k"][0].eq(3).all()


def test_the_switch_set_after_import_turns_every_compiled_path(monkeypatch, calls):
    monkeypatch.delenv("KVTIER_NATIVE", raising=False)
    storage_loop = pageio.compiled()  # where built and bound to xxhash's XXH3
    _every_path()
    assert set(calls) == {f for functions in FUNCTIONS.values() for f in functions}
    assert native.path_name() == "native"

    calls.clear()
    monkeypatch.setenv("KVTIER_NATIVE", "0")
    _every_path()
    assert calls == [] and native.path_name() == "numpy" and pageio.compiled() is False

    monkeypatch.setenv("KVTIER_NATIVE", "1")
    _every_path()
    assert "walk_run" in calls and "copy_jobs" in calls and pageio.compiled() is storage_loop


def test_a_module_that_is_not_built_is_none_and_imported_once():
    assert compiled.switched_on() or compiled.load(tokens.COMPILED) is None
    assert compiled.built("kvtier.no_such_module") is None and compiled.load("kvtier.no_such_module") is None
    assert compiled.built(tokens.COMPILED) is compiled.built(tokens.COMPILED)


def test_the_switch_reads_the_environment_as_it_is_now(monkeypatch):
    for value, on in (("0", False), ("1", True), ("", True), ("yes", True)):
        monkeypatch.setenv("KVTIER_NATIVE", value)
        assert compiled.switched_on() is on
    monkeypatch.delenv("KVTIER_NATIVE")
    assert compiled.switched_on() is True
