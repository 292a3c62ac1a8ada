"""The README's and docs' vLLM examples run as written on vLLM's CPU backend, each in a
process of its own (they start and shut down engines, which tears down vLLM's
process-wide parallel state); every `vllm serve` line names only settings the spec
takes (the server tests run that command line)."""

import json
import shlex
import subprocess
import sys

import pytest

pytest.importorskip("vllm.config")

from kvtier.integrations.vllm.config import KVTierConfig  # noqa: E402
from tests.test_readme import blocks, python_blocks  # noqa: E402


def test_pages_have_vllm_examples():
    assert python_blocks("vllm"), "no python example in README.md or docs/*.md imports vllm"
    assert [b for b in blocks("sh") if "vllm serve" in b.code], "no sh block in README.md or docs/*.md runs vllm serve"


@pytest.mark.parametrize("block", python_blocks("vllm"), ids=lambda b: b.name)
def test_vllm_example_runs(block, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(block.code)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("same tokens: True") == 2, run.stdout
    assert "host tier: 0 of" not in run.stdout and "storage: 0 of" not in run.stdout, run.stdout


@pytest.mark.parametrize("block", [b for b in blocks("sh") if "vllm serve" in b.code], ids=lambda b: b.name)
def test_vllm_serve_line_is_a_valid_configuration(block):
    argv = shlex.split(block.code.replace("\\\n", " "))
    assert argv[:2] == ["vllm", "serve"] and "--enable-prompt-tokens-details" in argv
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "OffloadingConnector"
    extra = transfer["kv_connector_extra_config"]
    assert extra["spec_name"] == "KVTierOffloadingSpec" and extra["spec_module_path"] == "kvtier.integrations.vllm"
    assert KVTierConfig.parse(extra).host_bytes == 16 << 30
