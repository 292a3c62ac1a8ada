"""sglang's tests run in .venv-sglang (``make test-sglang``); elsewhere each module skips.

NOTE: transformers is imported before the torchvision stand-in goes on ``sys.path``:
transformers decides once, at import, whether torchvision is available, and must
decide "no" (the stand-in cannot do what it would then ask of it).
"""

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.support.shm import removes_leftovers

if importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("torchvision") is None:
    import transformers  # noqa: F401 - see the NOTE above

    sys.path.insert(0, str(Path(__file__).parent / "standin"))


@pytest.fixture(scope="session", autouse=True)
def _no_shm_leftovers():
    """The slot files sglang's killed servers leave in /dev/shm removed after the session,
    and the named semaphores (``sem.mp-*``) of their multiprocessing locks (one a server)."""
    with removes_leftovers("sglang_loads_", "sem.mp-"):
        yield
