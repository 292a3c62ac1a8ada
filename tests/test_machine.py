"""The CPU cache sizes read from sysfs (``kvtier.machine``)."""

import pytest

from kvtier.machine import cache_bytes
from tests.support.sysfs import cache_dir


_XEON = [("1", "Data", "48K"), ("1", "Instruction", "32K"), ("2", "Unified", "2048K"), ("3", "Unified", "307200K")]


@pytest.mark.parametrize("level, want", [(1, 48 << 10), (2, 2 << 20), (3, 300 << 20), (4, 0)])
def test_each_level_reads_its_data_or_unified_cache(tmp_path, level, want):
    assert cache_bytes(level, cache_dir(tmp_path, _XEON)) == want


@pytest.mark.parametrize("size, want", [("1M", 1 << 20), ("96M", 96 << 20), ("1G", 1 << 30), ("4096", 4096)])
def test_sizes_in_each_unit(tmp_path, size, want):
    assert cache_bytes(3, cache_dir(tmp_path, [("3", "Unified", size)])) == want


def test_the_default_where_sysfs_does_not_tell(tmp_path):
    assert cache_bytes(3, cache_dir(tmp_path / "a", [("3", "Unified", "lots")]), default=5) == 5
    assert cache_bytes(2, cache_dir(tmp_path / "b", [("2", "Instruction", "1M")]), default=6) == 6
    assert cache_bytes(3, str(tmp_path / "missing"), default=7) == 7
