"""Run a sweep's replays and Belady computations side by side (``kvtier simulate --jobs``).

Each task is independent and deterministic: a replay of the whole trace at one
configuration (:class:`Replay`), or Belady's hits at one capacity (:class:`Oracle`).
:func:`run_tasks` returns their results in task order, whatever the number of
workers, so ``--jobs N`` prints exactly what ``--jobs 1`` prints.

Workers are fresh Python processes (``python -c``, so none inherits this process's
torch threads) that talk JSON lines over their stdin and stdout
(:mod:`kvtier.sim.wire`): the trace once, then one task per line and one result per
line; nothing else crosses. They run in a session of their own and ignore SIGINT: a
terminal's Ctrl-C reaches only this process, which stops them and exits with one line.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
from typing import Callable, Sequence

import torch

from .simulator import SimResult, belady_hits, simulate
from .traces import Request
from .wire import Oracle, Replay, Task, read_result, read_task, read_trace, result_line, task_line, trace_line

__all__ = ["Oracle", "Replay", "Task", "cpu_count", "run_task", "run_tasks", "worker_main"]

_WORKER = "from kvtier.sim.parallel import worker_main; worker_main()"


def cpu_count() -> int:
    """CPUs this process may run on (``--jobs 0``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def run_task(requests: list[Request], task: Task, progress: Callable[[], None] | None = None) -> SimResult | int:
    """A replay's :class:`SimResult`, or Belady's hit tokens; ``progress`` is called per replayed request."""
    if isinstance(task, Replay):
        return simulate(requests, task.config, progress)
    return belady_hits(requests, task.capacity_tokens, task.block_tokens)


def run_tasks(requests: list[Request], tasks: Sequence[Task], jobs: int,
              done: Callable[[], None] | None = None) -> list:
    """Results of ``tasks`` in their order, computed by ``min(jobs, len(tasks))``
    worker processes (in this process when that is 1). ``done`` is called after each
    task finishes."""
    workers = min(jobs, len(tasks))
    if workers <= 1:
        out = []
        for task in tasks:
            out.append(run_task(requests, task))
            if done is not None:
                done()
        return out
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, start_new_session=True) for _ in range(workers)]
    out: list = [None] * len(tasks)
    try:
        trace = trace_line(requests) + "\n"
        todo = iter(enumerate(tasks))
        busy: dict[int, int] = {}  # worker -> index of the task it runs
        with selectors.DefaultSelector() as ready:
            for w, proc in enumerate(procs):
                proc.stdin.write(trace)
                ready.register(proc.stdout, selectors.EVENT_READ, w)
                _hand_out(procs, w, todo, busy)
            while busy:
                for key, _ in ready.select():
                    w = key.data
                    line = procs[w].stdout.readline()
                    if not line:
                        raise RuntimeError(f"simulate worker {w} exited with code {procs[w].wait()} "
                                           f"during task {busy[w]}")
                    out[busy.pop(w)] = read_result(line)
                    if done is not None:
                        done()
                    _hand_out(procs, w, todo, busy)
    finally:  # also on Ctrl-C or an error: the workers stop here
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                try:
                    pipe.close()
                except OSError:  # a worker killed mid-write: its pipe is broken, nothing to flush
                    pass
    return out


def _hand_out(procs, w: int, todo, busy: dict[int, int]) -> None:
    """Send worker ``w`` the next task, if any."""
    item = next(todo, None)
    if item is not None:
        busy[w] = item[0]
        procs[w].stdin.write(task_line(item[1]) + "\n")
        procs[w].stdin.flush()


def worker_main() -> None:
    """A ``--jobs`` worker: the trace on the first line of stdin, then a task per line,
    answered by a result per line on stdout, until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)  # the workers are the parallelism: intra-op threads would only contend
    requests = read_trace(sys.stdin.readline())
    for line in sys.stdin:
        sys.stdout.write(result_line(run_task(requests, read_task(line))) + "\n")
        sys.stdout.flush()
