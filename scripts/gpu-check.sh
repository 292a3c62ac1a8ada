#!/usr/bin/env bash
# kvtier's CUDA checks in one command, for a machine with an NVIDIA GPU whose python3
# already holds a CUDA torch and Triton (nothing is installed: the optional C extensions
# are built in place and kvtier runs from src/). Logs and JSON go to ${OUT:-gpu-check}/.
#
#   1. the CUDA tests (tests/transfer/test_cuda.py: every geometry x layout x backend x
#      page size, hybrid groups included, CUDA device pool <-> pinned host pool; and the
#      rest of the suite, whose CUDA cases skip without a device);
#   2. kvtier bench transfer --device cuda, page sizes 16/64/256, direct/kernel/auto;
#   3. kvtier bench overlap --device cuda;
#   4. kvtier demo --device cuda (the MiMo hybrid demo; outputs must be identical).
#
# The sglang host pool's CUDA cases need sglang's venv (make test-sglang) on the GPU
# machine: `.venv-sglang/bin/python -m pytest -q tests/integrations/sglang/test_host_pool.py`.
# Exit status: 0 when every step passed, 1 when one failed, 2 without a CUDA device.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" || { echo "no CUDA device"; exit 2; }
"$py" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.txt"
"$py" setup.py build_ext --inplace > "$out/build.log" 2>&1 || echo "extensions not built: pure paths (see build.log)"

failed=0
step() {  # step NAME TIMEOUT CMD...: run, log to $out/NAME.log, note a failure
    local name=$1 limit=$2
    shift 2
    echo "== $name"
    if ! timeout "$limit" "$@" > "$out/$name.log" 2>&1; then
        echo "   FAILED (tail of $out/$name.log):"
        tail -n 20 "$out/$name.log"
        failed=1
    fi
}
step test-cuda 600 "$py" -m pytest -q -x -p no:cacheprovider tests/transfer/test_cuda.py
step test-all 900 "$py" -m pytest -q -p no:cacheprovider -x --ignore=tests/integrations/vllm \
    --ignore=tests/integrations/sglang
step bench-transfer 600 "$py" -c "import sys; from kvtier.cli import main; sys.exit(main(sys.argv[1:]))" \
    bench transfer --device cuda --page-size 16,64,256 --backends direct,kernel,auto --json
step bench-overlap 600 "$py" -c "import sys; from kvtier.cli import main; sys.exit(main(sys.argv[1:]))" \
    bench overlap --device cuda --json
step demo 600 "$py" -c "import sys; from kvtier.cli import main; sys.exit(main(sys.argv[1:]))" demo --device cuda
[ -s "$out/bench-transfer.log" ] && cp "$out/bench-transfer.log" "$out/transfer.json"
[ -s "$out/bench-overlap.log" ] && cp "$out/bench-overlap.log" "$out/overlap.json"
echo "results in $out/ (failed: $failed)"
exit $failed
