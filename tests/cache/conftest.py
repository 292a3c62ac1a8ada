import sys
from pathlib import Path

import pytest

import kvtier.storage

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def store(tmp_path):
    """A file store in the test's own directory."""
    s = kvtier.storage.open(f"file://{tmp_path}")
    yield s
    s.close()
