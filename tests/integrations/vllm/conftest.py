"""vLLM's tests run in .venv-vllm (``make test-vllm``); elsewhere each module skips."""

import pytest

from tests.support.shm import removes_leftovers


@pytest.fixture(scope="session", autouse=True)
def _no_shm_leftovers():
    """The shared-memory segments vLLM's CPU workers leave in /dev/shm removed after the
    session, and the named semaphores (``sem.mp-*``) its killed servers' multiprocessing
    locks leave there."""
    with removes_leftovers("vllm_dist_", "sem.mp-"):
        yield
