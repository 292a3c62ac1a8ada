"""The README's "Use with vLLM" example runs as written on vLLM's CPU backend."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.config")  # a bare `vllm` may be this test folder

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from test_readme import python_blocks, run_block  # noqa: E402


def test_readme_vllm_example_runs(capsys):
    blocks = python_blocks("vllm")
    assert len(blocks) == 1
    run_block(blocks[0])
    out = capsys.readouterr().out
    assert out.count("same tokens: True") == 2, out
    assert "host tier: 0 of" not in out and "storage: 0 of" not in out, out
