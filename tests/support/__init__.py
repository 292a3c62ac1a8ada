"""Helpers for the tests: every module that a test imports but pytest does not collect.

One flat package, imported by its path (``from tests.support.pools import SPECS``); the
repository root is on ``sys.path`` because ``tests/`` and each folder below it are
packages (pytest's default ``prepend`` import mode puts the first folder above them
there), so no conftest.py edits ``sys.path``. A module shared by several test folders
is named for what it provides; one that serves a single area is named ``<area>_<what>``:

- ``pools``: the geometries every test runs over (``SPECS``, ``HYBRID_SPECS``,
  ``LAYOUT_ORDERS``) and byte-exact pool helpers (``bits``, ``fill_random``, ...).
- ``services``: real Redis, Redis Cluster and Mooncake servers; ``unavailable`` skips.
- ``storage``: filled host pools, page reads and resource limits for the storage tests.
- ``shm``: the engine suites' cleanup of the /dev/shm files their engines leave.
- ``seccomp``: a child process whose calls of one system call fail (an older kernel, a sandbox).
- ``hostile``: arguments that run Python while a compiled parser reads them.
- ``cache_engine``, ``cache_hybrid_engine``: a toy engine driving ``HierarchicalCache``
  (full-attention and hybrid); ``cache_faults``, ``cache_invariants``,
  ``cache_state_rig``: fault-injecting stores, drain checks, the threaded state rig.
- ``transformers_models``: the small hybrid Hugging Face models.
- ``vllm_rig``, ``vllm_scheduler_rig``, ``vllm_server``: vLLM's offloading rig, its
  scheduler rig and a ``vllm serve`` process (imported only in ``.venv-vllm``).
- ``sglang_rig``, ``sglang_server``: sglang's HiCache controller rig and a sglang
  server process (imported only in ``.venv-sglang``).

A test's subprocess that imports these puts ``ROOT`` on its own ``sys.path`` first.
"""

from pathlib import Path

#: The repository root: what a subprocess needs on ``sys.path`` to import ``tests.support``.
ROOT = Path(__file__).resolve().parents[2]
