"""The file store's registry of the names its objects are written under
(``kvtier.storage.file_names``): what lets a store bound to no geometry look a key up
without listing its shard."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import kvtier.storage
from kvtier.storage import file_names
from kvtier.storage.file import FileStorage
from tests.support.pools import SPECS
from tests.support.storage import blank_host, filled_host, flat_pages, object_files

SPEC = SPECS["asym"]  # 4 K and 4 V heads: a whole writer's file, or one per rank of 2


def keys_for(n, start=0):
    return kvtier.storage.page_keys(list(range(start, start + 4 * n)), 4, namespace="n")


def _no_listing(monkeypatch):
    def refuse(shard):
        raise AssertionError(f"listed {shard}")
    monkeypatch.setattr(FileStorage, "_listed", staticmethod(refuse))


def _write_two_geometries(tmp_path):
    """Keys 0-2 by a whole writer, keys 3-5 by the two ranks of a writer of 2 (other names)."""
    full, idx = filled_host(SPEC, 3, seed=1)
    keys = keys_for(6)
    assert kvtier.storage.open(f"file://{tmp_path}").batch_set(keys[:3], full, idx) == [True] * 3
    for rank in range(2):
        shard, sidx = filled_host(SPEC.shard(rank, 2), 3, seed=2 + rank)
        assert kvtier.storage.open(f"file://{tmp_path}").batch_set(keys[3:], shard, sidx) == [True] * 3
    return keys


def test_an_unbound_store_finds_every_writers_keys_by_their_names_without_listing(tmp_path, monkeypatch):
    """Writers name their files' names before writing; a store bound to no geometry asks
    each key under those names only (no shard is listed, whatever the store holds) and
    finds the keys of every writer, a key none wrote missing."""
    keys = _write_two_geometries(tmp_path)
    assert sorted(file_names.registered(str(tmp_path / "kvtier-v5"))) == sorted(
        {p.name.split(".", 1)[1] for p in object_files(tmp_path)})
    assert len(file_names.registered(str(tmp_path / "kvtier-v5"))) == 3  # the whole writer's, each rank's
    _no_listing(monkeypatch)
    unbound = kvtier.storage.open(f"file://{tmp_path}")
    asked = keys + keys_for(1, start=100)
    assert unbound.exists_each(asked) == [True] * 6 + [False]
    assert unbound.batch_exists(asked) == 6 and unbound.batch_exists(keys_for(1, start=100) + keys) == 0
    assert unbound.stats()["errors"] == 0


def test_batch_exists_asks_no_key_after_the_first_missing_one(tmp_path, monkeypatch):
    """How many leading keys are there: the keys after the first missing one are not
    looked up (bound or not); ``exists_each`` asks every key."""
    keys = _write_two_geometries(tmp_path)
    asked_keys = keys[:2] + keys_for(1, start=100) + keys[2:]
    for bound in (False, True):
        store = kvtier.storage.open(f"file://{tmp_path}", **({"spec": SPEC, "page_size": 4} if bound else {}))
        stems, real = [], store._stem
        monkeypatch.setattr(store, "_stem", lambda key: stems.append(key) or real(key))
        assert store.batch_exists(asked_keys) == 2
        assert stems == asked_keys[:3], bound
        stems.clear()
        assert store.exists_each(asked_keys) == [True, True, False, True, True, True, True]
        assert stems == asked_keys


def test_a_store_without_a_registry_or_with_a_bad_one_lists_its_shards(tmp_path):
    """No registry (a store written before it), a link in its place, or more names than
    ``MAX_NAMES``: the shards are listed, with the same answers; nothing outside the
    store is followed."""
    keys = _write_two_geometries(tmp_path)
    root = tmp_path / "kvtier-v5"
    asked = keys + keys_for(1, start=100)
    want = [True] * 6 + [False]
    unbound = kvtier.storage.open(f"file://{tmp_path}")
    names = root / "names"
    outside = tmp_path / "outside"
    shutil.move(names, outside)
    assert file_names.registered(str(root)) is None and unbound.exists_each(asked) == want
    names.symlink_to(outside)  # a link: not followed, even to the true names
    assert file_names.registered(str(root)) is None and unbound.exists_each(asked) == want
    names.unlink()
    names.mkdir()
    for i in range(file_names.MAX_NAMES + 1):
        (names / f"n{i}").touch()
    assert file_names.registered(str(root)) is None and unbound.exists_each(asked) == want
    (names / "n0").unlink()  # MAX_NAMES names, none of them the objects': trusted, so nothing is found
    assert len(file_names.registered(str(root))) == file_names.MAX_NAMES
    assert unbound.exists_each(asked) == [False] * 7 and unbound.stats()["errors"] == 0


def test_a_write_that_cannot_name_its_files_still_stores_them(tmp_path):
    """The registry cannot be made (a file at its name): one counted error, the pages are
    stored and read back, and a store bound to their geometry finds them."""
    host, idx = filled_host(SPEC, 2, seed=4)
    store = kvtier.storage.open(f"file://{tmp_path}")
    (tmp_path / "kvtier-v5" / "names").write_bytes(b"not a directory")
    keys = keys_for(2)
    assert store.batch_set(keys, host, idx) == [True] * 2
    assert store.stats()["errors"] == 1 and len(object_files(tmp_path)) == 2
    reader, ridx = blank_host(SPEC, 8)
    assert store.batch_get(keys, reader, ridx) == [True] * 2
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), flat_pages(host, idx)))
    assert kvtier.storage.open(f"file://{tmp_path}", spec=SPEC, page_size=4).batch_exists(keys) == 2


def test_clear_takes_the_registry_and_the_next_write_names_again(tmp_path):
    """A clear leaves no name behind (the store is empty); the next write, by the same
    store, names its files again, so an unbound store finds them by name."""
    host, idx = filled_host(SPEC, 2, seed=5)
    keys = keys_for(2)
    store = kvtier.storage.open(f"file://{tmp_path}")
    assert store.batch_set(keys, host, idx) == [True] * 2
    root = str(tmp_path / "kvtier-v5")
    assert len(file_names.registered(root)) == 1
    store.clear()
    assert file_names.registered(root) is None and store.batch_exists(keys) == 0
    assert store.batch_set(keys, host, idx) == [True] * 2
    assert len(file_names.registered(root)) == 1
    assert kvtier.storage.open(f"file://{tmp_path}").batch_exists(keys) == 2


@pytest.mark.parametrize("umask", [0o000, 0o077])
def test_a_registry_takes_the_stores_modes(tmp_path, umask):
    """The registry directory and its names have the store's modes, whatever the umask."""
    import stat

    old = os.umask(umask)
    try:
        file_names.register(str(tmp_path), "a.b", 0o660, lambda p: os.mkdir(p, 0o770) or os.chmod(p, 0o770))
        file_names.register(str(tmp_path), "a.b", 0o660, None)  # there already: nothing made
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "names").stat().st_mode) == 0o770
    assert stat.S_IMODE((tmp_path / "names" / "a.b").stat().st_mode) == 0o660
    assert file_names.registered(str(tmp_path)) == ["a.b"]


def test_a_link_at_the_registrys_name_is_not_followed(tmp_path):
    """A link planted where the registry should be: a write names nothing through it (no
    file appears where it points), counts the fault, and stores its pages all the same;
    an unbound store reads it as no registry and lists the shards."""
    outside = tmp_path / "outside"
    outside.mkdir()
    store = kvtier.storage.open(f"file://{tmp_path / 'store'}")
    (tmp_path / "store" / "kvtier-v5" / "names").symlink_to(outside)
    host, idx = filled_host(SPEC, 2, seed=6)
    keys = keys_for(2)
    assert store.batch_set(keys, host, idx) == [True] * 2
    assert list(outside.iterdir()) == [] and store.stats()["errors"] == 1
    unbound = kvtier.storage.open(f"file://{tmp_path / 'store'}")
    assert unbound.exists_each(keys + keys_for(1, 50)) == [True, True, False]
