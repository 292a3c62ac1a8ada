"""sglang's own HTTP server (``python -m sglang.launch_server`` on the CPU) serving a
sliding-window model, with HiCache and kvtier as its ``dynamic`` L3 backend over a
``file://`` store: a tiny random Mellum (JetBrains' Qwen3-MoE variant, ``model_type``
``mellum``, ``MellumForCausalLM``; every MLP dense) whose layers mix sliding (a 64-token
window, 4 pages of 16) and full attention. sglang gives it hybrid SWA pools: a full KV
pool and a sliding one, each with a kvtier host pool (``KVTIER_SGLANG_HOST_POOL=all``:
sglang's own host pool dies on CPU-only torch), which it registers with kvtier through
the v2 interface (``register_mem_host_pool_v2``, ``batch_exists_v2`` with the sliding
pool's ``TRAILING_PAGES``, ``batch_get_v2``/``batch_set_v2``).

Two servers: the first fills the store and restores a flushed prompt from it; the
second, on the same store with a device pool too small for two prompts, restores it
from storage, then from its host tier once another prompt evicted it.

NOTE: two stand-ins go on the servers' ``PYTHONPATH`` (written by the ``standin``
fixture), besides the torchvision one: ``sgl_kernel`` (no CPU wheel here; only the two
functions sglang's CPU path calls are real, see shared ENGINES.md) and a
``sitecustomize`` that fixes one sglang 0.5.23 bug on this path: its ``torch_native``
attention backend writes a sliding layer's K/V at the SWA pool's slots
(``translate_loc_from_full_to_swa``) but reads them back at the full pool's slots
(``k_cache[req_to_token[...]]`` with ``get_key_buffer`` the SWA buffer), so sliding
layers attend to whatever those SWA slots hold and sglang's own text depends on the
allocators' history (a cold prefill and a prefix hit differ, with or without kvtier).
The fix reads through the translated slots, as sglang's ``intel_amx`` backend does
(``_swa_kv_indices``); then the restored sliding pages decide the text, and a prompt's
text is the same cold, from the device, host or storage.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt")  # a bare `sglang` may be this test folder

from services import unavailable  # noqa: E402

from kvtier.bench.servers import free_port  # noqa: E402
from kvtier.integrations.vllm.tiny import prompt  # noqa: E402

HERE = Path(__file__).parent
PAGE, WINDOW, MAX_NEW = 16, 64, 16
LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
#: ~360 tokens each, first pages all different (sglang's default prefetch_threshold is 256 tokens)
PROMPT_A, PROMPT_B, PROMPT_C = prompt(170, 0), prompt(170, 5), prompt(170, 9)
_HEAD = struct.Struct("<4sHHQQH")  # kvtier.storage.codec's fixed header; the object's name follows
#: What sglang's HTTP server imports (scripts/sglang-env.sh installs them; elsewhere the tests skip).
SERVER_MODULES = ["fastapi", "uvicorn", "uvloop", "setproctitle", "interegular", "multipart", "prometheus_client",
                  "einops", "jsonschema", "xgrammar", "soundfile"]
READY = "The server is fired up and ready to roll"
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


class Server:
    """``python -m sglang.launch_server`` in its own process group, logging to a file."""

    def __init__(self, model: Path, store: Path, standin: Path, log: Path, max_total_tokens: int) -> None:
        self.log, self.port = log, free_port()
        storage = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
                   "class_name": "KVTierStorage", "url": f"file://{store}"}
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu",
                "--attention-backend", "torch_native", "--cuda-graph-backend-decode", "disabled",
                "--cuda-graph-backend-prefill", "disabled", "--max-total-tokens", str(max_total_tokens),
                "--page-size", str(PAGE), "--enable-hierarchical-cache", "--hicache-ratio", "4",
                "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
                "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(storage),
                "--hicache-storage-prefetch-policy", "wait_complete", "--enable-cache-report",
                "--host", "127.0.0.1", "--port", str(self.port)]
        kvtier_src = Path(importlib.util.find_spec("kvtier").origin).parents[1]
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "KVTIER_SGLANG_HOST_POOL": "all",
               "PYTHONPATH": os.pathsep.join([str(standin), str(HERE / "standin"), str(kvtier_src)])}
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 400.0) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if READY in self.log_text():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang exited with {self.proc.returncode}:\n{self.log_text()[-6000:]}")
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"sglang not ready after {timeout}s:\n{self.log_text()[-6000:]}")

    def log_text(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return self.log.read_text(errors="replace")

    def _post(self, path: str, body: dict | None = None) -> bytes:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                     json.dumps(body).encode() if body is not None else b"",
                                     {"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.read()

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

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL to what is left after 20 s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            self.proc.poll()
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        self._out.close()


def save_mellum(path: Path) -> Path:
    """A tiny random Mellum with the offline tokenizer of kvtier's tiny vLLM models."""
    from transformers import MellumConfig

    from kvtier.integrations.vllm.tiny import _common, _save

    def config(vocab):
        return MellumConfig(**_common(vocab, 256, len(LAYERS)), num_attention_heads=8, num_key_value_heads=2,
                            head_dim=64, sliding_window=WINDOW, layer_types=LAYERS,
                            mlp_layer_types=["dense"] * len(LAYERS), num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=128, architectures=["MellumForCausalLM"])
    return _save(path, 300, 0, "bfloat16", config)


def stored_keys(store: Path) -> dict[str, list[Path]]:
    """Each stored object's key (the name in its headers, less ``#<field>``) with its files (one per head group)."""
    keys = {}
    for path in store.rglob("*"):
        if path.is_file() and not path.name.startswith("."):
            head = path.read_bytes()[:4096]
            magic, *_, n = _HEAD.unpack_from(head)
            if magic == b"KVT1":
                keys.setdefault(head[_HEAD.size:_HEAD.size + n].decode().split("#")[0], []).append(path)
    return keys


def assert_clean(log: str) -> None:
    bad = [line for line in log.splitlines() if any(b in line for b in BAD_LINES)]
    assert not bad, "\n".join(bad[:20])


def assert_serves_both_pools(log: str) -> None:
    assert FIXED in log
    assert "Use sliding window memory pool" in log and "hicache_attached=True" in log
    assert "kvtier storage file bound to sglang pool kv:" in log
    assert "kvtier storage file bound to sglang pool swa:" in log
    served = [line for line in log.splitlines() if "kvtier storage serves sglang host pools:" in line]
    assert len(served) == 1, served
    # the full pool has the one full layer, the sliding one the three sliding layers
    assert "kv (L1-bf16-k=2x64-v=2x64, KVTierMHAHostPool), swa (L3-bf16-k=2x64-v=2x64, KVTierMHAHostPool)" \
        in served[0], served
    assert_clean(log)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        unavailable(f"sglang's HTTP server needs {', '.join(missing)} in this venv (scripts/sglang-env.sh)")
    return tmp_path_factory.mktemp("sglang-hybrid")


@pytest.fixture(scope="module")
def model(work):
    return save_mellum(work / "mellum")


@pytest.fixture(scope="module")
def standin(work):
    path = work / "standin"
    (path / "sgl_kernel").mkdir(parents=True)
    (path / "sgl_kernel" / "__init__.py").write_text(SGL_KERNEL)
    (path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return path


@pytest.fixture(scope="module")
def store(work):
    path = work / "store"
    path.mkdir()
    return path


#: What the first server saw, for the tests after it (they run in file order).
SEEN: dict = {}


@pytest.fixture(scope="module")
def first(model, store, standin, work):
    server = Server(model, store, standin, work / "first.log", max_total_tokens=2048).wait_ready()
    yield server
    server.stop()


def test_kvtier_serves_both_pools_and_a_flushed_prompt_comes_back_from_storage(first, store):
    """kvtier is bound to both of sglang's host pools; after ``/flush_cache`` a prompt's
    whole pages come from storage, and its text is the one sglang gave from the device."""
    assert_serves_both_pools(first.log_text())
    cold = first.generate(PROMPT_A)
    assert cold.cached == 0 and cold.prompt_tokens > 256 + PAGE
    device = first.generate(PROMPT_A)
    assert (device.cached, device.device, device.host, device.storage) == (device.full_pages, device.full_pages, 0, 0)
    assert cold.text == device.text  # sliding layers read what they wrote (the fix): one text
    first.flush()  # device and host emptied, storage writes done
    restored = first.generate(PROMPT_A)
    assert (restored.cached, restored.device, restored.host, restored.storage) == \
        (restored.full_pages, 0, 0, restored.full_pages)
    assert restored.text == device.text
    # C's objects alone: for the next server, which finds them without their ~swa objects
    first.flush()
    before = set(stored_keys(store))
    c = first.generate(PROMPT_C)
    assert c.cached == 0
    first.flush()
    SEEN.update(text=device.text, c_text=c.text, c_pages=(c.prompt_tokens + MAX_NEW - 1) // PAGE,
                c_keys=set(stored_keys(store)) - before)
    assert_clean(first.log_text())


def test_storage_holds_sliding_pages_beside_full_ones(first, store):
    """The SWA pool's pages are objects of their own (``<page hash>~swa``, the sliding
    layers' geometry), for the pages of the window before a prompt's end only."""
    if not SEEN:
        pytest.skip("needs the first server's test")
    keys = stored_keys(store)
    swa = {k for k in keys if k.endswith("~swa")}
    kv = set(keys) - swa
    assert swa and kv and len(swa) < len(kv), (len(swa), len(kv))
    assert {k[:-len("~swa")] for k in swa} <= kv  # a sliding page is a page of the full pool too
    assert all(p.name.startswith("L3-") for k in swa for p in keys[k])
    assert all(p.name.startswith("L1-") for k in kv for p in keys[k])
    # C alone: a KV object for each whole page of its prompt and answer; ~swa objects
    # for the window before each stored node's end only (the prompt's node and the
    # answer's: 4 or 5 pages of 16 tokens)
    c_swa = {k for k in SEEN["c_keys"] if k.endswith("~swa")}
    assert len(SEEN["c_keys"] - c_swa) == SEEN["c_pages"]
    assert WINDOW // PAGE <= len(c_swa) <= WINDOW // PAGE + 2, sorted(c_swa)


def test_a_new_server_restores_from_storage_then_from_host(model, store, standin, work, first):
    """Same store, a device pool of 512 tokens (two prompts do not fit): the prompt the
    first server stored comes back from storage, then, evicted by another, from host;
    a prompt whose sliding pages were removed gets no storage hit (sglang asks for the
    trailing window; kvtier never answers a prefix it cannot restore whole)."""
    if not SEEN:
        pytest.skip("needs the first server's test")
    first.stop()
    stored = stored_keys(store)
    for key in SEEN["c_keys"]:
        if key.endswith("~swa"):
            for path in stored[key]:
                path.unlink()
    server = Server(model, store, standin, work / "second.log", max_total_tokens=512).wait_ready()
    try:
        assert_serves_both_pools(server.log_text())
        c = server.generate(PROMPT_C)
        assert (c.cached, c.storage) == (0, 0)
        assert c.text == SEEN["c_text"]
        a = server.generate(PROMPT_A)
        assert (a.cached, a.device, a.host, a.storage) == (a.full_pages, 0, 0, a.full_pages)
        assert a.text == SEEN["text"]
        b = server.generate(PROMPT_B)
        assert b.cached == 0
        again = server.generate(PROMPT_A)  # B took A's device pages: A's come from host
        assert (again.cached, again.device, again.host, again.storage) == (a.full_pages, 0, a.full_pages, 0)
        assert again.text == SEEN["text"]
        assert_clean(server.log_text())
    finally:
        server.stop()
