"""Checks a command runs before it starts working: output paths, optional modules, memory.

Each raises ``UsageError`` with the numbers, which the command line prints as one line.
"""

from __future__ import annotations

import errno
import importlib.util
import os
from pathlib import Path

from ..errors import UsageError
from .table import human_bytes

#: Share of this machine's memory one run may plan to use; above it the run is refused.
HOST_FRACTION = 0.8
#: Share of the accelerator's free memory one run may plan to use.
DEVICE_FRACTION = 0.9
#: Torch sizes are int64: no tensor, even on the ``meta`` device, may reach this many bytes.
TORCH_MAX_BYTES = 2**63 - 1


def check_output_path(path: str | None, flag: str) -> None:
    """``path`` can be created or overwritten as a file: its directory exists and is writable."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    parent = target.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")
    # NOTE: os.access says yes to root everywhere; /proc and /sys refuse at the open. Opened
    # as the run will (appending to a file that exists: nothing in it changes), closed at once
    existed = target.exists()
    try:
        # (non-blocking: a FIFO with no reader yet would hold the open; it answers ENXIO then)
        os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK
                         | (0 if existed else os.O_CREAT | os.O_EXCL), 0o644))
    except OSError as e:
        if e.errno != errno.ENXIO:
            raise UsageError(f"{flag} {path}: cannot be written ({e.strerror or e})") from None
    if not existed:
        target.unlink(missing_ok=True)


def check_input_file(path: str, what: str) -> None:
    """``path`` exists and is not a directory (a regular file, a pipe or a device is read as given)."""
    target = Path(path)
    if not target.exists():
        raise UsageError(f"{what} {path}: no such file")
    if target.is_dir():
        raise UsageError(f"{what} {path}: is a directory, not a file")


def require_module(module: str, why: str, extra: str) -> None:
    """``module`` is importable; otherwise name the extra that installs it."""
    if importlib.util.find_spec(module) is None:
        raise UsageError(f"{why} needs the Python package {module!r}: pip install 'kvtier[{extra}]'")


def host_memory_bytes() -> int | None:
    """Physical memory, or the cgroup's limit when lower; ``None`` where neither is known."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def check_host_memory(nbytes: int, what: str, hint: str) -> None:
    """Refuse a run planning ``nbytes`` of host memory above :data:`HOST_FRACTION` of the machine."""
    check_torch_bytes(nbytes, what, hint)
    total = host_memory_bytes()
    if total is not None and nbytes > HOST_FRACTION * total:
        raise UsageError(f"{what} needs about {human_bytes(nbytes)} of memory, more than {HOST_FRACTION:.0%} of "
                         f"this machine's {human_bytes(total)}; {hint}")


#: host bytes a copy of a trace takes per request (a ``Request`` and its tuple) and per block id (a new int)
TRACE_REQUEST_BYTES, TRACE_ID_BYTES = 200, 40


def check_trace_copies(requests: int, blocks: int, times: int, flag: str) -> None:
    """Refuse ``times`` copies of a trace of ``requests`` requests and ``blocks`` block ids
    that would not fit in host memory, before any copy is made."""
    if times > 1:
        nbytes = (times - 1) * (requests * TRACE_REQUEST_BYTES + blocks * TRACE_ID_BYTES)
        check_host_memory(nbytes, f"{flag} {times} (about {requests * times:,} requests)", f"use a smaller {flag}")


def check_device_memory(nbytes: int, device, what: str, hint: str) -> None:
    """Refuse a run planning ``nbytes`` on accelerator ``device`` above :data:`DEVICE_FRACTION` of its free memory."""
    import torch

    check_torch_bytes(nbytes, what, hint)
    if torch.device(device).type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(torch.device(device))
    if nbytes > DEVICE_FRACTION * free:
        raise UsageError(f"{what} needs about {human_bytes(nbytes)} on {device}, more than {DEVICE_FRACTION:.0%} of "
                         f"its free {human_bytes(free)} (of {human_bytes(total)}); {hint}")


def check_torch_bytes(nbytes: int, what: str, hint: str) -> None:
    if nbytes > TORCH_MAX_BYTES:
        raise UsageError(f"{what} would be {nbytes:.3g} bytes, beyond torch's 2^63-byte limit; {hint}")
