"""``file:///dir``: one file per page part, in sharded directories; the embedded default.

    <dir>/kvtier-v1/<h[0:2]>/<h[2:]>/<field>     h = sha256(key), field = "<fingerprint>.p<page size>.<part>"

Key text never becomes a path (it is hashed), so no key can leave ``dir``. KV is as
sensitive as the prompts it came from: directories are created 0700 and objects 0600
(owner only, whatever the umask), or 0770 / 0660 with ``shared`` for a cache that a
group of users' engines share. Writes
go to a temporary file in the same directory and are renamed into place
(``os.replace``), so readers see a whole object or none. With ``capacity_bytes``
the least recently used keys are evicted; the LRU order is seeded from directory
mtimes at open, and a hit touches its directory, so it survives restarts.

Reads trust nothing found in the directory: an object is opened with
``O_NOFOLLOW | O_NONBLOCK`` (a symlink or a FIFO neither redirects nor blocks the
read), must be a regular file, and is read only if its size is the size the
reader's plan expects, into a buffer of that size. A file of another size gives at
most its header to judge it by. Anything else is a miss and a counted error.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import stat
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from .codec import Partial, header_size
from .objectstore import ObjectStorage
from .options import Opt, check_options

_ROOT = "kvtier-v1"
_counter = itertools.count()
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class NotAnObject(OSError):
    """Something other than a regular file sits at an object's path."""


class FileStorage(ObjectStorage):
    scheme = "file"
    OPTIONS = {**ObjectStorage.OPTIONS, "capacity_bytes": Opt(int, 1, none_ok=True), "fsync": Opt(bool),
               "shared": Opt(bool)}
    CHUNK_BYTES = 4 << 20  # about a core's share of the CPU cache (see ObjectStorage.CHUNK_BYTES)

    def __init__(self, path: str | os.PathLike, *, capacity_bytes: int | None = None, fsync: bool = False,
                 shared: bool = False, **options) -> None:
        super().__init__(**options)
        check_options(self.OPTIONS, capacity_bytes=capacity_bytes, fsync=fsync, shared=shared)
        self.root = Path(path).resolve() / _ROOT
        self._dir_mode, self._file_mode = (0o770, 0o660) if shared else (0o700, 0o600)
        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            self._mkdir(self.root)
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError(13, "not writable")
        except OSError as e:
            raise ValueError(f"file storage: cannot use directory {self.root}: {e.strerror or e}") from None
        self._root_name = str(self.root)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._lock = threading.Lock()
        self._lru: OrderedDict[Path, int] = OrderedDict()  # key dir -> bytes, oldest first
        self._total = 0  # sum of self._lru's values
        if capacity_bytes is not None:
            self._scan()

    # -- paths -------------------------------------------------------------------------------
    def _key_dir(self, key: str) -> Path:
        return Path(self._key_dir_name(key))

    def _key_dir_name(self, key: str) -> str:
        """``_key_dir`` as a str: reads build their paths as strings (pathlib costs more per
        object than the open, fstat and close together)."""
        h = hashlib.sha256(key.encode()).hexdigest()
        return f"{self._root_name}/{h[:2]}/{h[2:]}"

    @staticmethod
    def _file_name(field: str) -> str:
        return field.replace("/", ".")  # fingerprints and part names hold [A-Za-z0-9=-_] only

    def _path(self, key: str, field: str) -> Path:
        return self._key_dir(key) / self._file_name(field)

    # -- primitives ------------------------------------------------------------------------------
    def _put(self, items) -> list[bool]:
        ok = []
        for key, field, blob in items:
            try:
                self._write(self._path(key, field), blob)
                ok.append(True)
            except OSError as e:
                self._fault("write", e)
                ok.append(False)
        return ok

    def _mkdir(self, path: Path) -> None:
        """``path`` as a directory of this store's mode (an existing one is left as it is)."""
        try:
            os.mkdir(path, self._dir_mode)
        except FileExistsError:
            if os.path.isdir(path) and not os.path.islink(path):
                return
            raise
        os.chmod(path, self._dir_mode)  # exactly: the umask may have taken bits the mode wants

    def _write(self, path: Path, blob: np.ndarray) -> None:
        if not path.parent.is_dir():
            self._mkdir(path.parent.parent)
            self._mkdir(path.parent)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_counter)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, self._file_mode)
            os.fchmod(fd, self._file_mode)
            with open(fd, "wb", buffering=0) as f:
                view = memoryview(blob)
                while view:  # one raw write may take fewer bytes than offered
                    view = view[f.write(view):]
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.capacity_bytes is not None:
            self._account(path.parent, blob.nbytes)

    def _get(self, items, dest):
        """A generator: each object is read when the caller asks for it (see ObjectStorage._get)."""
        dirs: dict[str, str] = {}  # key -> its directory (shared by the parts of a page)
        touched = set()
        for (key, field), buf in zip(items, dest):
            d = dirs.get(key)
            if d is None:
                d = dirs[key] = self._key_dir_name(key)
            try:
                blob = self._read(f"{d}/{self._file_name(field)}", buf, f"{key}#{field}")
            except FileNotFoundError:
                blob = None
            except OSError as e:
                self._fault("read", e)
                blob = None
            if blob is not None and self.capacity_bytes is not None and d not in touched:
                touched.add(d)
                self._touch(Path(d))
            yield blob

    @staticmethod
    def _read(path: str, buf: np.ndarray, name: str):
        """The object at ``path`` read into ``buf`` if it is a regular file of exactly
        ``buf.nbytes`` bytes or fewer; else a :class:`Partial` of its first bytes, at most
        the header an object ``name`` would have."""
        fd = os.open(path, _READ_FLAGS)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotAnObject(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)})")
            want = st.st_size if st.st_size <= buf.nbytes else min(header_size(name), buf.nbytes)
            view, got = memoryview(buf)[:want], 0
            while got < want:  # a read may return fewer bytes than asked
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    break
                got += n
            return buf[:got] if st.st_size <= buf.nbytes else Partial(view[:got], st.st_size)
        finally:
            os.close(fd)

    def _has(self, items) -> list[bool]:
        return [self._is_object(self._path(k, f)) for k, f in items]

    @staticmethod
    def _is_object(path: Path) -> bool:
        try:
            return stat.S_ISREG(os.lstat(path).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    def _has_any(self, keys) -> list[bool]:
        out = []
        for key in keys:
            d = self._key_dir(key)
            try:
                out.append(any(not e.name.startswith(".") for e in os.scandir(d)))
            except FileNotFoundError:
                out.append(False)
        return out

    def _remove(self, items) -> None:
        for key, field in items:
            self._path(key, field).unlink(missing_ok=True)

    def _remove_keys(self, keys) -> None:
        for key in keys:
            d = self._key_dir(key)
            shutil.rmtree(d, ignore_errors=True)
            with self._lock:
                self._total -= self._lru.pop(d, 0)

    def _remove_all(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self._mkdir(self.root)
        with self._lock:
            self._lru.clear()
            self._total = 0

    # -- capacity ------------------------------------------------------------------------------
    def _scan(self) -> None:
        dirs = []
        for shard in self.root.iterdir():
            for d in (shard.iterdir() if shard.is_dir() and not shard.is_symlink() else ()):
                if not d.is_dir() or d.is_symlink():
                    continue
                size = sum(f.lstat().st_size for f in d.iterdir() if not f.name.startswith("."))
                dirs.append((d.stat().st_mtime, d, size))
        for _, d, size in sorted(dirs, key=lambda t: t[0]):
            self._lru[d] = size
            self._total += size
        self._evict()

    def _account(self, key_dir: Path, nbytes: int) -> None:
        with self._lock:
            self._lru[key_dir] = self._lru.pop(key_dir, 0) + nbytes
            self._total += nbytes
        self._evict(keep=key_dir)

    def _touch(self, key_dir: Path) -> None:
        with self._lock:
            if key_dir in self._lru:
                self._lru.move_to_end(key_dir)
        try:
            os.utime(key_dir)
        except OSError:
            pass

    def _evict(self, keep: Path | None = None) -> None:
        """Drop least recently used keys (never ``keep``) until the total fits the capacity."""
        while True:
            with self._lock:
                victims = [d for d in self._lru if d != keep][:1]
                if self._total <= self.capacity_bytes or not victims:
                    return
                self._total -= self._lru.pop(victims[0])
            shutil.rmtree(victims[0], ignore_errors=True)
            self._stats.add(evictions=1)

    def usage_bytes(self) -> int:
        """Bytes held, as tracked for the capacity (0 when no capacity is set)."""
        with self._lock:
            return self._total

