"""A seccomp filter that answers one system call with an errno: for a child process
that plays an older kernel (``ENOSYS``) or a sandbox that forbids the call (``EPERM``).
The filter is the process's for good, so it goes in a child (:func:`run_denied`)."""

from __future__ import annotations

import ctypes
import platform
import struct
import subprocess
import sys

from tests.support import ROOT

#: the calls this knows, by number (Linux x86_64 and aarch64 number them alike)
NUMBERS = {"cachestat": 451}

_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06  # classic BPF: load a word of seccomp_data, compare, return
_RET_ERRNO, _RET_ALLOW = 0x00050000, 0x7FFF0000
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def available() -> bool:
    """Whether this machine's system call numbers are the ones :data:`NUMBERS` holds."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")


def deny(name: str, err: int) -> None:
    """From now on, this process's calls of ``name`` fail with ``err`` (for good)."""
    code = [(_LD_W_ABS, 0, 0, 0),  # the call's number (seccomp_data.nr)
            (_JEQ_K, 0, 1, NUMBERS[name]),
            (_RET_K, 0, 0, _RET_ERRNO | err),
            (_RET_K, 0, 0, _RET_ALLOW)]
    raw = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in code))
    program = _Program(len(code), ctypes.addressof(raw))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter refused: {err}")


def run_denied(name: str, err: int, code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Python ``code`` run in a child (in the repository's root, so that ``tests`` imports)
    whose calls of ``name`` fail with ``err``; its output captured as text."""
    prelude = f"from tests.support.seccomp import deny; deny({name!r}, {err})\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
