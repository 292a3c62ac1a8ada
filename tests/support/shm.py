"""The shared-memory files an engine leaves in /dev/shm, removed once a test session's
servers are gone.

sglang's servers leave ``sglang_loads_*`` slot files (their teardown kills processes,
which skips the unlink), vLLM's CPU workers ``vllm_dist_*`` segments, and both
engines' killed servers the ``sem.mp-*`` files of Python's multiprocessing semaphores.
A file is removed only if it appeared during the session and no live process holds it
open or mapped, so a concurrent session's running engine keeps its files.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

SHM = Path("/dev/shm")


def _names(prefixes: tuple[str, ...]) -> set[str]:
    try:
        return {n for n in os.listdir(SHM) if n.startswith(prefixes)}
    except OSError:
        return set()


def _held() -> set[str]:
    """The /dev/shm files some live process holds open or has mapped."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as maps:
                held.update(line.split(maxsplit=5)[5].strip() for line in maps if f"{SHM}/" in line)
    return {h.removesuffix(" (deleted)") for h in held}


@contextlib.contextmanager
def removes_leftovers(*prefixes: str):
    """Around a test session: on leaving, the new files of ``prefixes`` that nothing holds
    are unlinked."""
    before = _names(prefixes)
    try:
        yield
    finally:
        new = _names(prefixes) - before
        if new and Path("/proc/self/fd").is_dir():
            held = _held()
            for name in new:
                if str(SHM / name) not in held:
                    with contextlib.suppress(FileNotFoundError):
                        (SHM / name).unlink()
