"""``scripts/gpu-check.sh``, the one command for the CUDA checks: without a CUDA device
it says so and exits 2 before any work (no build, no test run), and it names each step."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the script would run the checks")
def test_without_a_device_it_stops_at_once(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(SCRIPT)], env={**os.environ, "OUT": str(out), "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "no CUDA device" in run.stdout
    assert not (out / "build.log").exists()


def test_it_runs_every_cuda_check():
    text = SCRIPT.read_text()
    for step in ("tests/transfer/test_cuda.py", "bench transfer --device cuda --page-size 16,64,256 "
                 "--backends direct,kernel,auto", "bench overlap --device cuda", "demo --device cuda"):
        assert step in text
