
import pytest

import kvtier.storage


@pytest.fixture
def store(tmp_path):
    """A file store in the test's own directory."""
    s = kvtier.storage.open(f"file://{tmp_path}")
    yield s
    s.close()
