"""The README's Python examples must run as written: the engine examples in the
engine's own virtual environment (tests/integrations/*/test_readme_example.py), the
rest here."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
ENGINES = ("vllm", "sglang")


def python_blocks(engine: str | None = None) -> list[str]:
    """The README's ``python`` blocks that import ``engine`` (None: those importing no engine)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    uses = {b: next((e for e in ENGINES if re.search(rf"^\s*(from|import) {e}\b", b, flags=re.M)), None)
            for b in blocks}
    return [b for b in blocks if uses[b] == engine]


def run_block(code: str) -> None:
    exec(compile(code, str(README), "exec"), {"__name__": "__main__"})


def test_readme_python_blocks_run():
    blocks = python_blocks()
    assert blocks, "README has no python example"
    for code in blocks:
        run_block(code)


def test_engine_examples_are_run_where_the_engine_is():
    for engine in ENGINES:
        if python_blocks(engine):
            assert (Path(__file__).parent / "integrations" / engine / "test_readme_example.py").exists()
