"""The README's "Use with vLLM" example runs as written on vLLM's CPU backend, in a
process of its own (it starts and shuts down engines, which tears down vLLM's
process-wide parallel state)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.config")  # a bare `vllm` may be this test folder

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from test_readme import python_blocks  # noqa: E402


def test_readme_vllm_example_runs(tmp_path):
    blocks = python_blocks("vllm")
    assert len(blocks) == 1
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("same tokens: True") == 2, run.stdout
    assert "host tier: 0 of" not in run.stdout and "storage: 0 of" not in run.stdout, run.stdout
