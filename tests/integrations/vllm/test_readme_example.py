"""The README's "Use with vLLM" example runs as written on vLLM's CPU backend, in a
process of its own (it starts and shuts down engines, which tears down vLLM's
process-wide parallel state); its `vllm serve` line names only settings the spec
takes (the server tests run that command line)."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.config")  # a bare `vllm` may be this test folder

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from test_readme import README, python_blocks  # noqa: E402

from kvtier.integrations.vllm.config import KVTierConfig  # noqa: E402


def test_readme_vllm_example_runs(tmp_path):
    blocks = python_blocks("vllm")
    assert len(blocks) == 1
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("same tokens: True") == 2, run.stdout
    assert "host tier: 0 of" not in run.stdout and "storage: 0 of" not in run.stdout, run.stdout


def test_readme_vllm_serve_line_is_a_valid_configuration():
    (line,) = [b for b in re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S) if "vllm serve" in b]
    argv = shlex.split(line.replace("\\\n", " "))
    assert argv[:2] == ["vllm", "serve"] and "--enable-prompt-tokens-details" in argv
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "OffloadingConnector"
    extra = transfer["kv_connector_extra_config"]
    assert extra["spec_name"] == "KVTierOffloadingSpec" and extra["spec_module_path"] == "kvtier.integrations.vllm"
    assert KVTierConfig.parse(extra).host_bytes == 16 << 30
