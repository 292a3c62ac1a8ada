"""``tests.support.shm.removes_leftovers``: the engine suites' cleanup of /dev/shm removes
only what appeared during its span and nothing holds."""

import os
import uuid

import pytest

from tests.support.shm import SHM, removes_leftovers


def test_only_new_files_nothing_holds_are_removed():
    if not SHM.is_dir() or not os.access(SHM, os.W_OK) or not os.path.isdir("/proc/self/fd"):
        pytest.skip("no writable /dev/shm and /proc")
    prefix = f"kvtier_test_{uuid.uuid4().hex[:8]}_"
    old, new, held = (SHM / f"{prefix}{n}" for n in ("old", "new", "held"))
    other = SHM / f"kvtier_other_{uuid.uuid4().hex[:8]}"  # another prefix
    old.write_bytes(b"1")
    fd = None
    try:
        with removes_leftovers(prefix):
            new.write_bytes(b"2")
            held.write_bytes(b"3")
            other.write_bytes(b"4")
            fd = os.open(held, os.O_RDONLY)
        assert not new.exists()
        assert old.exists() and held.exists() and other.exists()
    finally:
        if fd is not None:
            os.close(fd)
        for path in (old, new, held, other):
            path.unlink(missing_ok=True)
