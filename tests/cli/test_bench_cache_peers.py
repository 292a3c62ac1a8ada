"""``kvtier bench cache`` without a working sglang: one line says the sglang comparison was
skipped and why, and the command succeeds (the comparison itself is tested in
``tests/integrations/sglang/test_bench_cache_peers.py``, where sglang is installed)."""

import importlib
import importlib.util
import importlib.machinery
import json
import sys
import types

import pytest

from kvtier.bench._torchvision_standin import torchvision_standin
from kvtier.cli import main

SMALL = ["--page-sizes", "16", "--prompt-tokens", "256", "--tree-pages", "200"]


def run(capsys, *argv):
    code = main(["bench", "cache", *SMALL, *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def no_sglang(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # imports of it fail, as where it is not installed


@pytest.fixture
def broken_sglang(monkeypatch):
    """An ``sglang`` that imports but has none of 0.5.23's modules."""
    stub = types.ModuleType("sglang")
    stub.__spec__ = importlib.machinery.ModuleSpec("sglang", None)
    stub.__version__ = "0.0.1"
    monkeypatch.setitem(sys.modules, "sglang", stub)


def test_without_sglang_the_text_report_ends_with_the_skip_line(capsys, no_sglang):
    code, out, err = run(capsys)
    assert code == 0 and "Traceback" not in err
    assert out.splitlines()[-1] == "skipped sglang: sglang is not installed in this environment"
    assert "beside sglang" not in out


def test_without_sglang_the_json_names_the_skip(capsys, no_sglang):
    code, out, _ = run(capsys, "--json")
    result = json.loads(out)
    assert code == 0 and "sglang" not in result
    assert result["skipped"] == {"sglang": "sglang is not installed in this environment"}
    assert [r["page_size"] for r in result["rows"]] == [16]


def test_an_sglang_without_its_cache_modules_is_one_line_too(capsys, broken_sglang):
    code, out, err = run(capsys)
    assert code == 0 and "Traceback" not in err
    line = out.splitlines()[-1]
    assert line.startswith("skipped sglang: sglang 0.0.1 (the comparison follows 0.5.23's API): ModuleNotFoundError")
    assert "sglang.srt" in line


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed here")
def test_the_torchvision_stand_in_answers_imports_only_within():
    with torchvision_standin() as standin:
        import torchvision.transforms as T
        from torchvision.transforms import InterpolationMode

        placeholder = InterpolationMode.BICUBIC
        with pytest.raises(RuntimeError, match="stand-in"):
            T.Resize(224)
    assert standin is True
    assert "torchvision" not in sys.modules and "torchvision.transforms" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("torchvision")
    with pytest.raises(RuntimeError, match="stand-in"):
        placeholder()  # what imported it keeps a placeholder that still refuses
