"""The compiled copy's kept threads (``kvtier/transfer/_copy_pool.h``).

A call split over threads runs its parts on threads kept between calls: they must
serve every later call (none started per call), sleep once calls stop, leave every
byte where a call asked (two callers at once, a forked child), and read their spin
setting from the environment. Each process-wide fact is checked in a fresh interpreter.
"""

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from tests.transfer.test_native import _jobs

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="threads are started per call on Windows")

# NOTE: each script runs in a fresh interpreter, so the kept threads it sees are its own
_PRELUDE = textwrap.dedent("""\
    import os, sys, time
    import numpy as np
    sys.path.insert(0, os.getcwd())
    from kvtier.transfer import _native
    from tests.transfer.test_native import _jobs

    def copy(seed, threads, pages=64, block=64):
        jobs, dsts, wants = _jobs(np.random.default_rng(seed), 3, pages, block)
        _native.copy_jobs(jobs, threads)
        return all(np.array_equal(d, w) for d, w in zip(dsts, wants))
""")


def _run(compiled_module, script: str, **env) -> str:
    """``script`` after the prelude in a fresh interpreter, from the repository root; its stdout."""
    assert compiled_module is not None
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    environ = {**os.environ, **env}
    if "KVTIER_COPY_SPIN_US" not in env:
        environ.pop("KVTIER_COPY_SPIN_US", None)
    done = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(script)], cwd=root, env=environ,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_threads_of_a_split_call_serve_every_later_call(compiled):
    """The first call split three ways starts two threads; twenty more calls, split two or
    three ways, start none, and every call's bytes land."""
    out = _run(compiled, """
        assert _native.copy_threads() == (0, 0, -1)
        assert copy(1, 3)
        first = _native.copy_threads()[0]
        ok = all(copy(seed, 2 + seed % 2) for seed in range(20))
        print(first, _native.copy_threads()[0], ok)
    """)
    assert out.split() == ["2", "2", "True"]


@pytest.mark.parametrize("spin", ["0", "100"])
def test_kept_threads_sleep_once_calls_stop(compiled, spin):
    """Spinning for the next call ends: with the default spin and with none, both kept
    threads are asleep soon after the last call, and the next call still lands."""
    out = _run(compiled, """
        assert copy(1, 3)
        deadline = time.monotonic() + 30
        while _native.copy_threads()[1] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        print(*_native.copy_threads(), copy(2, 3))
    """, KVTIER_COPY_SPIN_US=spin)
    assert out.split() == ["2", "2", spin, "True"]


@pytest.mark.parametrize(("value", "spin_us"), [("250", "250"), ("0", "0"), ("abc", "100"), ("-5", "100"),
                                                ("12x", "100"), (None, "100")])
def test_spin_is_read_from_the_environment_at_the_first_copy(compiled, value, spin_us):
    """KVTIER_COPY_SPIN_US in microseconds; anything but a whole number >= 0 is the
    default's 100; read at the first copy, not after (-1 before it)."""
    env = {} if value is None else {"KVTIER_COPY_SPIN_US": value}
    out = _run(compiled, """
        before = _native.copy_threads()[2]
        _native.copy_jobs([], 1)
        os.environ["KVTIER_COPY_SPIN_US"] = "7"
        copy(1, 2)
        print(before, _native.copy_threads()[2])
    """, **env)
    assert out.split() == ["-1", spin_us]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_only_calls_in_a_burst_wake_sleeping_threads(compiled):
    """A small call long after the last one (an isolated backup) runs on its own thread and
    leaves the kept threads asleep: none of them is switched in. Two calls a moment apart
    are a burst: the second wakes them for the calls to come."""
    out = _run(compiled, """
        def switches():
            tasks = os.listdir("/proc/self/task")
            kept = [t for t in tasks if open(f"/proc/self/task/{t}/comm").read().strip() == "kvtier-copy"]
            return sum(int(line.split()[1]) for t in kept for line in open(f"/proc/self/task/{t}/status")
                       if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")))

        def asleep():
            deadline = time.monotonic() + 30
            while _native.copy_threads()[1] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.05)

        copy(1, 3)  # starts them
        asleep()
        before = switches()
        lone = copy(2, 3)  # 12 KiB, long after the last call
        time.sleep(0.05)
        isolated = switches() - before
        (first, dsts, wants), (second, dsts2, wants2) = (_jobs(np.random.default_rng(s), 3, 64) for s in (3, 4))
        _native.copy_jobs(first, 3)
        _native.copy_jobs(second, 3)  # right after the first: a burst, which wakes them
        burst = all(np.array_equal(d, w) for d, w in zip(dsts + dsts2, wants + wants2))
        asleep()
        print(lone and burst, isolated, switches() - before > isolated)
    """)
    assert out.split() == ["True", "0", "True"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kept_threads_block_every_signal(compiled):
    """Signals go to the process's own threads: the kept ones (named kvtier-copy) block
    SIGINT, SIGTERM and SIGALRM, and the thread that started them blocks none of them."""
    out = _run(compiled, """
        import signal
        assert copy(1, 3)

        def blocked(task):
            status = open(f"/proc/self/task/{task}/status").read()
            mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
            return all(mask >> (s - 1) & 1 for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM))

        tasks = os.listdir("/proc/self/task")
        kept = [t for t in tasks if open(f"/proc/self/task/{t}/comm").read().strip() == "kvtier-copy"]
        print(len(kept), all(blocked(t) for t in kept), blocked(str(os.getpid())))
    """)
    assert out.split() == ["2", "True", "False"]


def test_a_forked_child_copies_on_threads_of_its_own(compiled):
    """After the parent's threads served a call, a forked child's split copy starts its
    own (the parent's do not exist there) instead of waiting on them. The child's copies
    move 4.5 MiB, so they split whether the parent's threads were asleep or not."""
    out = _run(compiled, """
        import signal
        assert copy(1, 2)
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)  # a child waiting on its parent's threads would hang here
            big = copy(2, 2, pages=128, block=4096) and copy(3, 2, pages=128, block=4096)
            os._exit(0 if big and _native.copy_threads()[0] == 1 else 1)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), copy(4, 2))
    """)
    assert out.split() == ["0", "True"]


def test_copies_from_two_threads_at_once_all_land(compiled):
    """Two Python threads copying at once (the GIL is released during a copy): one holds
    the kept threads, the other starts its own; every copy of both lands."""
    results, errors = [], []

    def copies(seed):
        try:
            for i in range(40):
                jobs, dsts, wants = _jobs(np.random.default_rng(seed * 100 + i), 2, 32)
                compiled.copy_jobs(jobs, 2)
                results.append(all(np.array_equal(d, w) for d, w in zip(dsts, wants)))
        except BaseException as e:  # noqa: BLE001 (re-raised below, on the test's thread)
            errors.append(e)

    workers = [threading.Thread(target=copies, args=(seed,)) for seed in (1, 2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not errors and not any(w.is_alive() for w in workers)
    assert len(results) == 80 and all(results)
