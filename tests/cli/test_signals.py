"""Ctrl-C and a closed output pipe, in a real process: one line and 130, or silence and 141."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

# The console script's own body, with a line on stdout once everything is imported.
SCRIPT = "import sys; from kvtier.cli import main; print('ready', flush=True); sys.exit(main(sys.argv[1:]))"


def _interruptible() -> None:
    """SIGINT as a terminal leaves it: a job started in the background (``cmd &`` in a
    non-interactive shell, as CI may run) inherits it ignored, and Python then never
    installs its KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def kvtier(*argv, **popen):
    return subprocess.Popen([sys.executable, "-c", SCRIPT, *argv], stderr=subprocess.PIPE,
                            preexec_fn=_interruptible, **popen)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_exits_130_with_one_line():
    # a long replay: the same synthetic workload at 40 host capacities
    sweep = ",".join(str(4096 * (i + 1)) for i in range(40))
    proc = kvtier("simulate", "synthetic", "--synthetic-sessions", "2000", "--block-tokens", "64", "--device-tokens",
                  "4096", "--sweep", f"host-tokens={sweep}", "--json", stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        time.sleep(1.0)  # into the replay
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and out == ""
    assert err.splitlines() == ["kvtier simulate: interrupted"]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("delay", [0.5, 4.0])
def test_ctrl_c_with_worker_processes_exits_130_with_one_line(delay):
    # a terminal sends Ctrl-C to the whole process group: the fork server and the workers too,
    # while they import torch (0.5 s) or replay (4 s); none of them may print a traceback
    sweep = ",".join(str(4096 * (i + 1)) for i in range(40))
    proc = kvtier("simulate", "synthetic", "--synthetic-sessions", "2000", "--block-tokens", "64", "--device-tokens",
                  "4096", "--sweep", f"host-tokens={sweep}", "--json", "--jobs", "2", stdout=subprocess.PIPE,
                  text=True, start_new_session=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and out == ""
    assert err.splitlines() == ["kvtier simulate: interrupted"]


@pytest.mark.skipif(shutil.which("head") is None, reason="needs head")
def test_closed_pipe_is_quiet():
    # more JSON than a pipe buffers, so writing it meets the closed pipe
    sweep = ",".join(str(1024 * (i + 1)) for i in range(400))
    proc = kvtier("simulate", "synthetic", "--synthetic-sessions", "2", "--device-tokens", "1024", "--sweep",
                  f"host-tokens={sweep}", "--json", stdout=subprocess.PIPE)
    head = subprocess.Popen(["head", "-c", "10"], stdin=proc.stdout, stdout=subprocess.PIPE)
    proc.stdout.close()  # head holds the only read end
    got = head.communicate(timeout=120)[0]
    err = proc.communicate(timeout=120)[1].decode()
    assert got == b"ready\n[\n  {"[:10]
    assert proc.returncode == 141 and err == ""
