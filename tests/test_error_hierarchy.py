"""One error module: every class in kvtier.errors, importable from its old home too, with the
built-in base callers catch; and no ``assert`` left in the product to guard anything."""

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import kvtier
from kvtier import errors

SRC = Path(kvtier.__file__).parent

#: class -> its built-in base besides KVTierError (Exception: none)
BUILTIN = {
    "UsageError": ValueError, "TraceError": ValueError, "IntegrityError": RuntimeError,
    "UnsupportedError": Exception, "UnsupportedLayoutError": NotImplementedError,
    "UnsupportedVLLMSetupError": NotImplementedError, "UnsupportedModelError": ValueError,
    "UnsupportedPoolError": ValueError, "UnsupportedHostPoolError": ValueError, "CacheClosedError": RuntimeError,
    "LoadError": RuntimeError, "RegionError": RuntimeError, "ServerUnavailable": RuntimeError,
    "CorruptObject": Exception, "UnexpectedObject": Exception, "BackendDown": ConnectionError,
    "NotAnObject": OSError,
}
#: where each class lived before kvtier.errors held them all, and the engine that module needs
#: (sglang's host pool: tests/integrations/sglang/test_host_pool.py, beside its torchvision stand-in)
OLD_HOMES = [
    ("kvtier.storage.file", "NotAnObject", None),
    ("kvtier", "IntegrityError", None), ("kvtier", "UnsupportedLayoutError", None),
    ("kvtier", "CacheClosedError", None), ("kvtier", "LoadError", None),
    ("kvtier.cache", "CacheClosedError", None), ("kvtier.cache", "LoadError", None),
    ("kvtier.cache", "IntegrityError", None),
    ("kvtier.cache.handles", "CacheClosedError", None), ("kvtier.cache.handles", "LoadError", None),
    ("kvtier.sim", "TraceError", None), ("kvtier.sim.traces", "TraceError", None),
    ("kvtier.layout", "UnsupportedLayoutError", None),
    ("kvtier.integrations.transformers", "UnsupportedModelError", None),
    ("kvtier.integrations.sglang.pools", "UnsupportedPoolError", None),
    ("kvtier.integrations.vllm.region", "RegionError", None),
    ("kvtier.integrations.vllm.spec", "UnsupportedVLLMSetupError", "vllm.v1.kv_offload.base"),
    ("kvtier.integrations.vllm", "UnsupportedVLLMSetupError", "vllm.v1.kv_offload.base"),
    ("kvtier.storage.codec", "CorruptObject", None), ("kvtier.storage.codec", "UnexpectedObject", None),
    ("kvtier.storage.faults", "BackendDown", None),
    ("kvtier.bench.servers", "ServerUnavailable", None),
]


def test_every_error_class_derives_from_kvtier_error_and_keeps_its_builtin_base():
    classes = {name: cls for name, cls in vars(errors).items()
               if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == errors.__name__}
    assert set(classes) == set(BUILTIN) | {"KVTierError"}
    for name, base in BUILTIN.items():
        assert issubclass(classes[name], errors.KVTierError) and issubclass(classes[name], base), name
    assert issubclass(errors.TraceError, errors.UsageError)
    assert all(issubclass(classes[n], errors.UnsupportedError) for n in BUILTIN if n.startswith("Unsupported"))
    assert not issubclass(errors.IntegrityError, ValueError)  # a bug is never shown as the caller's mistake


@pytest.mark.parametrize("module, name, engine", OLD_HOMES)
def test_an_error_is_importable_from_its_old_home(module, name, engine):
    if engine is not None:
        pytest.importorskip(engine)
    assert getattr(importlib.import_module(module), name) is getattr(errors, name)


def test_the_package_exports_the_core_errors():
    for name in ("KVTierError", "UsageError", "IntegrityError", "UnsupportedError", "UnsupportedLayoutError",
                 "CacheClosedError", "LoadError"):
        assert name in kvtier.__all__ and getattr(kvtier, name) is getattr(errors, name)


def test_no_assert_statement_guards_anything_in_the_product():
    # NOTE: ``python -O`` drops every assert: a check that matters raises a named error
    found = [f"{path.relative_to(SRC.parent)}:{node.lineno}" for path in sorted(SRC.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(node, ast.Assert)]
    assert found == []


def test_caller_mistakes_and_broken_invariants_raise_apart():
    from kvtier.cache.radix import RadixTree
    from kvtier.cache.tokens import token_array
    from kvtier.pools import PageAllocator

    a = PageAllocator(16, 4)
    with pytest.raises(errors.UsageError, match="not a multiple of page_size"):
        a.alloc(3)
    got = a.alloc(4)
    a.free(got)
    with pytest.raises(errors.IntegrityError, match="double free"):
        a.free(got)
    tree = RadixTree(4)
    node = tree.add_child(tree.root(b""), token_array(list(range(4))))
    with pytest.raises(errors.IntegrityError, match="unlock without a matching lock"):
        tree.unlock(node)
