"""Run a sweep's replays and Belady computations side by side (``kvtier simulate --jobs``).

Each task is independent and deterministic: a replay of the whole trace at one
configuration (:class:`Replay`), or Belady's hits at one capacity (:class:`Oracle`).
:func:`run_tasks` returns their results in task order, whatever the number of
workers, so ``--jobs N`` prints exactly what ``--jobs 1`` prints.

Workers are started by ``forkserver`` (``spawn`` where it does not exist): a clean
process that has imported torch but run nothing forks them, so no worker inherits a
parent's torch thread pool mid-use (which ``fork`` would risk). The server and the
workers ignore SIGINT: Ctrl-C stops the parent, which stops them and exits with one line.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from typing import Callable, NamedTuple, Sequence, Union

import torch

from .simulator import SimConfig, SimResult, belady_hits, simulate
from .traces import Request


class Replay(NamedTuple):
    config: SimConfig


class Oracle(NamedTuple):
    capacity_tokens: float
    block_tokens: int


Task = Union[Replay, Oracle]

_requests: list[Request] = []  # the trace, in a worker: sent once per worker, not once per task


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
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if ctx.get_start_method() == "forkserver":
        _start_forkserver(ctx)
    out: list = [None] * len(tasks)
    pool = None
    try:
        with _sigint_deferred():  # a worker cut off while receiving the trace would print a traceback
            pool = ctx.Pool(workers, initializer=_init_worker, initargs=(requests,))
        for i, result in pool.imap_unordered(_work, enumerate(tasks)):
            out[i] = result
            if done is not None:
                done()
    finally:
        if pool is not None:  # also on Ctrl-C or an error: the workers stop here
            pool.terminate()
    return out


@contextlib.contextmanager
def _sigint_deferred():
    """Hold a SIGINT that arrives inside the block and raise ``KeyboardInterrupt`` as
    the block ends (where Python's own handler is installed; else nothing changes)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    held = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


def _start_forkserver(ctx) -> None:
    """Start the fork server (once per process), importing this module (so torch) in it
    once for all workers, with SIGINT ignored: a terminal's Ctrl-C, sent to the whole
    process group, must not print tracebacks from the server's imports or a worker's;
    the server and every worker it forks keep that disposition."""
    from multiprocessing import forkserver

    ctx.set_forkserver_preload([__name__])
    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()  # signal dispositions can only be set from the main thread
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()  # NOTE: only the fork and exec happen here, not the server's imports
    finally:
        signal.signal(signal.SIGINT, previous)


def _init_worker(requests: list[Request]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)  # the workers are the parallelism: intra-op threads would only contend
    global _requests
    _requests = requests


def _work(item: tuple[int, Task]) -> tuple[int, SimResult | int]:
    i, task = item
    return i, run_task(_requests, task)
