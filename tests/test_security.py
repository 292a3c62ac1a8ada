"""Nothing that crosses a process or disk is deserialized with pickle."""

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvtier"


def test_no_pickle_anywhere_in_the_package():
    # multiprocessing and process pools pickle what they send between processes
    pattern = re.compile(r"\b(pickle|cPickle|dill|marshal|torch\.load|torch\.save|shelve|multiprocessing|"
                         r"ProcessPoolExecutor)\b")
    offenders = [f"{p.relative_to(SRC)}:{i}" for p in SRC.rglob("*.py")
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
