"""The names a file store's objects are written under, kept in the store itself.

An object's file is ``<shard>/<h[2:]>.<name>``: the key's hash, then a name that
says which writer's geometry wrote it (``FileStorage._file_name`` of its field).
A store bound to a geometry knows the names its key can have and asks each with
one ``lstat``. A store bound to none is asked whether *any* object of a key is
there: that needs every name writers have used, which only a listing of the
key's shard used to give, at 0.6 us an entry (a store of 262,144 objects, 1,024
a shard: 200-230 ms for 128 keys against 0.4-0.5 for a bound store; vLLM's
storage probe and the cache's ask through an unbound store).

So writers name their file names here before their first file of each name
lands: ``<root>/names/<name>``, one empty file per name. A store bound to no
geometry then asks each key's files under these names, a few ``lstat`` calls a
key, however many objects the store holds. A store written before there was a
registry (no ``names`` directory) is read by listing shards, as before. A name the
registry lacks (files written before it came, or by a writer that could not name
them: a counted fault) makes such a look-up say missing: a miss, never KV, since
a get still reads and checks whatever files it finds.

Nothing found here is trusted beyond being a name: a listed name cannot hold a
``/`` (the file system's names cannot), so ``<stem>.<name>`` stays in its
shard; a ``names`` that is a link, or holds more than ``MAX_NAMES`` names, is
read as no registry (listing again), so no directory can make a look-up slower
than the listing it replaces by more than that bound; and a writer names only
inside the registry's own directory, never through a link at its name.
"""

from __future__ import annotations

import os

DIRECTORY = "names"
#: Names a registry may hold and still be read (else shards are listed): each name
#: costs a missing key one ``lstat``. A geometry writes one name per writer's head-group
#: range, so even many tensor-parallel sizes share a model's store in a few dozen.
MAX_NAMES = 256
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def registered(root: str) -> list[str] | None:
    """The names in the registry of the store at ``root``; None where there is no
    registry to go by (none yet, not a directory, a link, more than ``MAX_NAMES``).
    Read anew each call: three system calls for a directory of a few entries."""
    try:
        fd = os.open(f"{root}/{DIRECTORY}", _DIR_FLAGS)
    except OSError:  # missing, a link (ELOOP), not a directory: listed instead
        return None
    try:
        names = os.listdir(fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    names = [n for n in names if not n.startswith(".")]
    return names if len(names) <= MAX_NAMES else None


def register(root: str, name: str, file_mode: int, mkdir) -> None:
    """Name ``name`` in the registry of the store at ``root`` (three system calls when it
    is there already: the registry opened, the name asked, closed); ``mkdir(path)``
    makes the registry where there is none yet. The name is made inside the registry's
    own directory, never through a link at its name. Raises ``OSError`` where it cannot
    (a link or a file at the registry's name too): the caller counts it."""
    try:
        fd = os.open(f"{root}/{DIRECTORY}", _DIR_FLAGS)
    except FileNotFoundError:  # the store's first name: make the registry
        mkdir(f"{root}/{DIRECTORY}")
        fd = os.open(f"{root}/{DIRECTORY}", _DIR_FLAGS)
    try:
        try:
            os.stat(name, dir_fd=fd, follow_symlinks=False)
            return
        except FileNotFoundError:
            pass
        try:
            new = os.open(name, _NEW_FLAGS, file_mode, dir_fd=fd)
        except FileExistsError:  # another writer named it meanwhile
            return
        try:
            os.fchmod(new, file_mode)  # the store's mode, whatever the umask (as its objects)
        finally:
            os.close(new)
    finally:
        os.close(fd)
