"""vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``, what ``vllm
serve`` runs) started for a test: its own process group, a log file, ready when
``/health`` answers; and the few HTTP calls the tests make."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvtier.bench.servers import free_port
from tests.support.services import EngineServer

#: What every test server gets; VLLM_SERVER_DEV_MODE adds POST /reset_prefix_cache.
BASE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
            "VLLM_SERVER_DEV_MODE": "1"}


def kvtier_transfer_config(**extra) -> str:
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"spec_name": "KVTierOffloadingSpec",
                                                     "spec_module_path": "kvtier.integrations.vllm", **extra}})


class Server(EngineServer):
    """``layout``: ``"default"`` (vLLM's own: engine core and workers in processes of
    their own) or ``"in-process"`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the worker runs
    in the engine core's process). ``cli``: start it as ``vllm serve MODEL`` (the venv's
    ``vllm`` command) rather than as the server module."""

    def __init__(self, model: str, log: Path, *, kvtier: dict | None = None, layout: str = "default",
                 tp: int = 1, cli: bool = False) -> None:
        self.model, port = model, free_port()
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env.update(BASE_ENV)
        if layout == "in-process":
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        start = [str(Path(sys.executable).with_name("vllm")), "serve", model] if cli else \
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        argv = [*start, "--port", str(port), "--host", "127.0.0.1", "--block-size", "32",
                "--max-model-len", "2048", "--dtype", "bfloat16", "--enforce-eager", "--enable-prefix-caching",
                "--seed", "0", "--enable-prompt-tokens-details", "--tensor-parallel-size", str(tp)]
        if kvtier is not None:
            argv += ["--kv-transfer-config", kvtier_transfer_config(**kvtier)]
        super().__init__(argv, env, log, port)

    def wait_ready(self, timeout: float = 300.0) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).read()
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM server not ready after {timeout}s:\n{self.log_text()[-4000:]}")

    def wait_exit(self, timeout: float = 300.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.stop()

    def _post(self, path: str, body: dict | None = None) -> dict:
        raw = super()._post(path, body, timeout=120)
        return json.loads(raw) if raw.strip() else {}

    def complete(self, prompt: str, max_tokens: int = 12) -> tuple[str, int]:
        """Greedy completion: ``(text, cached prompt tokens)``."""
        out = self._post("/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                             "temperature": 0})
        return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache")

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples by name with labels, e.g. ``'vllm:x_total{source="host"}'``
        (the engine and model labels dropped)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, value = line.rsplit(" ", 1)
            if "{" in name:
                base, labels = name[:-1].split("{", 1)
                kept = [p for p in labels.split(",") if not p.startswith(("engine=", "model_name="))]
                name = base + ("{" + ",".join(kept) + "}" if kept else "")
            out[name] = out.get(name, 0.0) + float(value)
        return out
