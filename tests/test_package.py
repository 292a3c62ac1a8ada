"""What ships (docs/architecture.md, "What ships in the package and why"): no kvtier module
imports the fixtures in ``kvtier.testing`` or anything under ``tests/``, and the modules
that moved keep their old import paths."""

import ast
import importlib
from pathlib import Path

import pytest

import kvtier

SRC = Path(kvtier.__file__).parent
#: the old import path of kvtier.testing.checkpoints, kept for code written against it
COMPAT = SRC / "integrations" / "vllm" / "tiny.py"


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, relative imports resolved against its package."""
    package = path.relative_to(SRC.parent).with_suffix("").parts
    package = package if path.name == "__init__.py" else package[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)  # ``from . import x``
    return out


def test_the_product_never_imports_test_fixtures():
    testing = SRC / "testing"
    found = [f"{path.relative_to(SRC)}: {name}" for path in sorted(SRC.rglob("*.py"))
             if testing not in path.parents and path != COMPAT
             for name in sorted(imported(path)) if name.startswith(("kvtier.testing", "tests"))
             or name.split(".")[0] in ("conftest", "helpers", "services")]
    assert not found, "\n".join(found)


def test_the_import_resolver_sees_relative_imports():
    assert {"kvtier.testing.checkpoints", "kvtier.testing.checkpoints.save_llama"} <= imported(COMPAT)
    assert "kvtier.tiny_models.build" in imported(SRC / "integrations" / "tiny_models.py")


@pytest.mark.parametrize("old, new, names", [
    ("kvtier.integrations.tiny_models", "kvtier.tiny_models", ("MODELS", "WINDOW", "build")),
    ("kvtier.integrations.vllm.tiny", "kvtier.testing.checkpoints", ("prompt", "save_hybrid", "save_llama")),
])
def test_a_moved_module_keeps_its_old_import_path(old, new, names):
    was, now = importlib.import_module(old), importlib.import_module(new)
    assert all(getattr(was, name) is getattr(now, name) for name in names)
