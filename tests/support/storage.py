"""Pools filled with known KV, and comparisons of what storage gave back."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
from pathlib import Path

import torch

from kvtier import HostKVPool, KVSpec
from kvtier.storage import pageio
from kvtier.storage.file import _SHARD_NAME
from tests.support.pools import bits, random_device_pool


def object_files(root) -> list[Path]:
    """The object files of the file stores under ``root``, sorted: those in shard
    directories, not the registry of their names (``kvtier.storage.file_names``)."""
    return sorted(p for p in Path(root).rglob("*") if p.is_file() and _SHARD_NAME.fullmatch(p.parent.name))


def filled_host(spec: KVSpec, pages: int, page_size: int = 4, layout: str = "page_first", seed: int = 0):
    """A host pool whose first ``pages`` pages hold random KV; returns (pool, slots)."""
    dev = random_device_pool(spec, pages * page_size, page_size, seed=seed)
    host = HostKVPool(spec, pages * page_size, page_size, layout=layout)
    idx = host.alloc(pages * page_size)
    host.backup_from_device_all_layer(dev, idx, torch.arange(pages * page_size))
    return host, idx


def blank_host(spec: KVSpec, slots: int, page_size: int = 4, layout: str = "page_first"):
    """A host pool of ``slots`` slots, every byte 0x5A (not the arbitrary bytes of fresh
    memory, which may hold a page another test loaded); returns (pool, all its slots)."""
    host = HostKVPool(spec, slots, page_size, layout=layout)
    for buf in host.buffers.values():
        buf.view(torch.uint8).fill_(0x5A)
    return host, host.alloc(slots)


def flat_pages(host: HostKVPool, idx: torch.Tensor) -> list[torch.Tensor]:
    return [bits(host.get_data_page(int(s))) for s in idx[:: host.page_size]]


def shard_flat(full_page: torch.Tensor, spec: KVSpec, page_size: int, rank: int, size: int) -> torch.Tensor:
    """Cut a full-spec flat page down to what ``spec.shard(rank, size)`` holds."""
    parts, offset = [], 0
    for c in spec.components:
        n = spec.layer_num * page_size * c.token_elems
        page = full_page[offset:offset + n].view(spec.layer_num, page_size, c.head_num, c.head_dim)
        if c.head_num > 1:
            h = c.head_num // size
            page = page[:, :, rank * h:(rank + 1) * h]
        parts.append(page.reshape(-1))
        offset += n
    return torch.cat(parts)


class PeakRSS:
    """Growth of the process's peak resident set over a block: ``with PeakRSS() as p: ...``,
    then ``p.growth`` in bytes. The peak (VmHWM) is reset at entry where Linux allows it
    (``/proc/self/clear_refs``), so earlier peaks of the test process do not hide growth."""

    @staticmethod
    def _status(field: str) -> int:
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no {field} in /proc/self/status")

    def __enter__(self) -> "PeakRSS":
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self.before = self._status("VmHWM")
        return self

    def __exit__(self, *exc) -> None:
        self.growth = self._status("VmHWM") - self.before


def run_bounded(fn, timeout: float = 60.0):
    """``fn()`` on a daemon thread; fails the test if it has not returned after ``timeout``
    seconds (a hang detector, not a speed check). Returns ``fn``'s result."""
    import threading

    out = {}

    def call() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised on the test's thread
            out["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"the call still runs after {timeout}s: it blocks"
    if "error" in out:
        raise out["error"]
    return out["value"]


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Writes past ``nbytes`` of any file fail (EFBIG), as a full disk fails them midway."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def cached_pages_of(path) -> int | None:
    """How many of the file ``path``'s pages the page cache holds (``pageio.cached_pages``:
    None where that cannot be counted)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return pageio.cached_pages(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def direct_allowed(directory) -> bool:
    """Whether a file in ``directory`` opens with O_DIRECT (the probe file removed again)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / "direct-probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
