"""sglang's own HTTP server (``python -m sglang.launch_server`` on the CPU) for the end-to-end
tests (test_hybrid_servers.py, test_llama_server.py): a server in its own process group
with HiCache and kvtier as its ``dynamic`` L3 backend over a ``file://`` store (or without
the hierarchical cache, for sglang's own texts), its greedy ``/generate`` answers with
where their cached tokens came from, ``/flush_cache``, and kvtier's stored objects.

NOTE: stand-ins go on the servers' ``PYTHONPATH`` (:func:`write_standin`), besides the
torchvision one: ``sgl_kernel`` (no CPU wheel here; only the two functions sglang's CPU
path calls are real) and, for sliding-window models, a
``sitecustomize`` that fixes sglang 0.5.23's ``torch_native`` reads of sliding layers on
hybrid SWA pools (test_hybrid_servers.py says why).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.servers import free_port
from kvtier.storage.pagefile import object_name
from tests.support.services import EngineServer, unavailable

#: The torchvision stand-in that sglang's tests put on the path (see their conftest.py).
TORCHVISION_STANDIN = Path(__file__).parents[1] / "integrations" / "sglang" / "standin"
PAGE, MAX_NEW = 16, 16
#: What sglang's HTTP server imports (scripts/sglang-env.sh installs them; elsewhere the tests skip).
SERVER_MODULES = ["fastapi", "uvicorn", "uvloop", "setproctitle", "interegular", "multipart", "prometheus_client",
                  "einops", "jsonschema", "xgrammar", "soundfile"]
READY = "The server is fired up and ready to roll"
#: uvicorn's line when the HTTP port was taken between ``free_port`` and sglang's bind
#: (seconds later, after the model loaded); sglang then waits, never ready, never exiting
BIND_FAILED = "error while attempting to bind on address"
#: Log lines that mean a storage call failed, or sglang reached a stand-in it should not.
BAD_LINES = ["HiCache storage query failed", "HiCache backup failed", "HiCache sidecar prefetch failed",
             "Write page to storage", "NotImplementedError", "Traceback", "kvtier: ", "sgl_kernel stand-in"]

SGL_KERNEL = '''\
"""Test stand-in for sgl_kernel (no CPU wheel here): the two functions sglang's CPU path
calls, in plain torch; any other name is a function that raises."""
import ctypes

import torch

__version__ = "0.0.0+kvtier-standin"


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """In every buffer (base address, bytes per slot), slot src_loc[i] to slot tgt_loc[i],
    every source read before any write."""
    tgt, src = tgt_loc.long().cpu(), src_loc.long().cpu()
    if tgt.numel() == 0:
        return
    top = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        slots = torch.frombuffer((ctypes.c_uint8 * (top * stride)).from_address(ptr), dtype=torch.uint8)
        slots = slots.view(top, stride)
        slots[tgt] = slots[src].clone()


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len):
    at = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[r, s:e] = out_cache_loc[at:at + e - s].to(req_to_token.dtype)
        at += e - s


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {name} is not implemented")
    missing.__name__ = name
    return missing
'''

SITECUSTOMIZE = '''\
"""Test fix for sglang 0.5.23's torch_native backend on hybrid SWA pools (see
test_hybrid_servers.py): a sliding layer reads its K/V through the SWA pool's slots,
as sglang's intel_amx backend does."""
import importlib.abc
import importlib.machinery
import sys

TARGET = "sglang.srt.layers.attention.torch_native_backend"


def _swa_reads(run):
    import functools
    import inspect

    import torch
    signature = inspect.signature(run)

    @functools.wraps(run)
    def fixed(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        a = bound.arguments
        window = a.get("sliding_window_size")
        if self.use_sliding_window_kv_pool and window is not None and window > -1:
            rows = a["req_to_token"][a["req_pool_indices"], : int(a["seq_lens"].max())]
            a["req_to_token"] = self.token_to_kv_pool.translate_loc_from_full_to_swa(rows).to(rows.dtype)
            a["req_pool_indices"] = torch.arange(rows.shape[0], device=rows.device)
        return run(*bound.args, **bound.kwargs)
    return fixed


class _Fix(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            cls = module.TorchNativeAttnBackend
            for method in ("_run_sdpa_forward_extend", "_run_sdpa_forward_decode"):
                setattr(cls, method, _swa_reads(getattr(cls, method)))
            print("kvtier test fix: torch_native reads sliding layers through SWA slots", file=sys.stderr)
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Fix())
'''
FIXED = "kvtier test fix: torch_native reads sliding layers through SWA slots"


def require_server_modules() -> None:
    """Skip (or fail, under KVTIER_REQUIRE_SERVICES=1) without sglang's HTTP server packages."""
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        unavailable(f"sglang's HTTP server needs {', '.join(missing)} in this venv (scripts/sglang-env.sh)")


def write_standin(path: Path, swa_fix: bool = True) -> Path:
    """The servers' stand-ins under ``path``: ``sgl_kernel``, and the sliding-window fix
    (``sitecustomize``) when ``swa_fix``; returns ``path``."""
    (path / "sgl_kernel").mkdir(parents=True)
    (path / "sgl_kernel" / "__init__.py").write_text(SGL_KERNEL)
    if swa_fix:
        (path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return path


@dataclass
class Answer:
    text: str
    prompt_tokens: int
    cached: int
    device: int
    host: int
    storage: int

    @property
    def full_pages(self) -> int:
        """The tokens of the prompt's whole pages before its last token: what a hit serves."""
        return (self.prompt_tokens - 1) // PAGE * PAGE


class Server(EngineServer):
    """``python -m sglang.launch_server`` in its own process group, logging to a file: with
    HiCache, kvtier's host pools and kvtier's L3 on ``store``, or, with ``store`` None,
    sglang alone (no hierarchical cache)."""

    def __init__(self, model: Path, store: Path | None, standin: Path, log: Path, max_total_tokens: int) -> None:
        self._args = (model, store, standin, log, max_total_tokens)
        port = free_port()
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu",
                "--attention-backend", "torch_native", "--cuda-graph-backend-decode", "disabled",
                "--cuda-graph-backend-prefill", "disabled", "--max-total-tokens", str(max_total_tokens),
                "--page-size", str(PAGE), "--enable-cache-report", "--host", "127.0.0.1", "--port", str(port)]
        kvtier_src = Path(importlib.util.find_spec("kvtier").origin).parents[1]
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join([str(standin), str(TORCHVISION_STANDIN), str(kvtier_src)])}
        env.pop("KVTIER_SGLANG_HOST_POOL", None)
        if store is not None:
            storage = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
                       "class_name": "KVTierStorage", "url": f"file://{store}"}
            argv += ["--enable-hierarchical-cache", "--hicache-ratio", "4", "--hicache-io-backend", "direct",
                     "--hicache-mem-layout", "layer_first", "--hicache-storage-backend", "dynamic",
                     "--hicache-storage-backend-extra-config", json.dumps(storage),
                     "--hicache-storage-prefetch-policy", "wait_complete"]
            env["KVTIER_SGLANG_HOST_POOL"] = "all"  # sglang's own host pool dies on CPU-only torch
        super().__init__(argv, env, log, port)

    def wait_ready(self, timeout: float = 400.0, retries: int = 2) -> "Server":
        """The server once it logged READY; started again on another port (``retries``
        times) where its port was taken before sglang bound it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_text()
            if READY in text:
                return self
            if BIND_FAILED in text and retries > 0:
                self.stop()
                self.__init__(*self._args)  # a new free port, the same log file
                return self.wait_ready(timeout, retries - 1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang exited with {self.proc.returncode}:\n{self.log_text()[-6000:]}")
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"sglang not ready after {timeout}s:\n{self.log_text()[-6000:]}")

    def _post(self, path: str, body: dict | None = None) -> bytes:
        return super()._post(path, body, timeout=300)

    def generate(self, text: str) -> Answer:
        """Greedy ``/generate`` of MAX_NEW tokens, with where its cached tokens came from."""
        out = json.loads(self._post("/generate", {"text": text, "sampling_params": {
            "temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}}))
        meta = out["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        return Answer(out["text"], meta["prompt_tokens"], meta.get("cached_tokens", 0),
                      *(details.get(k, 0) for k in ("device", "host", "storage")))

    def flush(self, timeout: float = 60.0) -> None:
        """``POST /flush_cache``: empties device and host once HiCache's transfers (storage
        writes included) are done; until then it answers 400."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._post("/flush_cache")
                return
            except urllib.error.HTTPError as e:
                if e.code != 400 or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def stored_keys(store: Path) -> dict[str, list[Path]]:
    """Each stored object's key (the name in its header, less ``#<field>``) with its files (one per page and writer)."""
    keys = {}
    for path in store.rglob("*"):
        if path.is_file() and not path.name.startswith("."):
            name = object_name(path.read_bytes()[:4096])
            if name is not None:
                keys.setdefault(name.split("#")[0], []).append(path)
    return keys


def field_name(path: Path) -> str:
    """The field part of a ``file://`` object's name (``<h[2:]>.<field>``, its slashes as dots)."""
    return path.name.partition(".")[2]


def assert_clean(log: str) -> None:
    bad = [line for line in log.splitlines() if any(b in line for b in BAD_LINES)]
    assert not bad, "\n".join(bad[:20])
