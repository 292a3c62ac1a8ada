"""The pool files that carry kvtier's vLLM host tier between the worker and the
scheduler (no vLLM needed): both sides see the same bytes; a file that is foreign,
torn, resized or a link is refused before it is mapped; engine ids cannot leave the
directory; files of dead creators are swept; a live one is never taken over."""

import os
import subprocess
import sys

import pytest
import torch

from kvtier.integrations.vllm import region as regions
from kvtier.integrations.vllm.blocks import Geometry, block_format, format_from_json, format_to_json
from kvtier.integrations.vllm.region import Region, RegionError, RegionInfo, region_path, sweep_stale

GQA = Geometry("CPU_ATTN", "LBHNC", False, 2, 32, 16, torch.bfloat16)
TP_SHARD = Geometry("CPU_ATTN", "LBHNC", False, 1, 32, 16, torch.bfloat16, 4, 2, 4)


def _info(engine="e1", rank=0, geometry=GQA, pages=6, pid=None):
    fmt = block_format(geometry, 3, 2 * 16 * geometry.num_kv_heads * 32 * 2)
    return RegionInfo(engine, rank, 4 if geometry.tp_size > 1 else 1, pid or os.getpid(), fmt, "page_head", pages)


@pytest.mark.parametrize("geometry", [GQA, TP_SHARD], ids=["whole", "tp-shard"])
def test_worker_and_scheduler_mappings_share_the_pages(tmp_path, geometry):
    info = _info(geometry=geometry, rank=geometry.tp_rank)
    mine = Region.create(tmp_path, info)
    theirs = Region.attach(tmp_path, "e1", geometry.tp_rank)
    assert theirs.info == info and theirs.pool.spec == mine.pool.spec
    assert theirs.pool.spec.head_range("k") == mine.pool.spec.head_range("k")
    src = torch.randint(-100, 100, mine.pool.buffers["k"].shape, dtype=torch.int16)
    mine.pool.buffers["k"].view(torch.int16).copy_(src)
    assert torch.equal(theirs.pool.buffers["k"].view(torch.int16), src)
    theirs.pool.buffers["v"].view(torch.int16).fill_(7)
    assert bool((mine.pool.buffers["v"].view(torch.int16) == 7).all())
    ptr, nbytes = mine.span()  # what a worker registers with the accelerator
    assert ptr == mine.pool.buffers["k"].data_ptr() and nbytes == info.file_bytes - regions.HEADER_BYTES
    theirs.unlink()
    assert not mine.path.exists()
    assert torch.equal(theirs.pool.buffers["k"].view(torch.int16), src)  # the mapping outlives the file


def test_formats_cross_as_json(tmp_path):
    for g in (GQA, TP_SHARD):
        fmt = block_format(g, 3, 2 * 16 * g.num_kv_heads * 32 * 2)
        again = format_from_json(format_to_json(fmt))
        assert again == fmt and again.spec.shard_of == fmt.spec.shard_of
    with pytest.raises(ValueError, match="dtype"):
        format_from_json({**format_to_json(block_format(GQA, 3, 4096)), "dtype": "pickle"})
    with pytest.raises(ValueError, match="block order"):
        format_from_json({**format_to_json(block_format(GQA, 3, 4096)), "order": ["os", "system"]})


def test_missing_file_is_none_and_foreign_files_are_refused(tmp_path):
    assert Region.attach(tmp_path, "e1", 0) is None
    path = region_path(tmp_path, "e1", 0)
    path.write_bytes(b"x" * (1 << 16))
    with pytest.raises(RegionError, match="no kvtier pool magic"):
        Region.attach(tmp_path, "e1", 0)
    path.unlink()
    region = Region.create(tmp_path, _info())
    with open(region.path, "r+b") as f:  # a header that lies about the size behind it
        f.truncate(region.info.file_bytes - 4096)
    with pytest.raises(RegionError, match="its header says"):
        Region.attach(tmp_path, "e1", 0)
    other = Region.create(tmp_path, _info(engine="e2"))
    os.rename(other.path, region_path(tmp_path, "e3", 0))
    with pytest.raises(RegionError, match="holds rank 0 .group 0. of engine 'e2'"):
        Region.attach(tmp_path, "e3", 0)


def test_links_are_not_followed(tmp_path):
    target = Region.create(tmp_path, _info(engine="real"))
    os.symlink(target.path, region_path(tmp_path, "alias", 0))
    with pytest.raises(RegionError, match="cannot open"):
        Region.attach(tmp_path, "alias", 0)


def test_engine_ids_stay_inside_the_directory(tmp_path):
    path = region_path(tmp_path, "../../etc/passwd", 0)
    assert path.parent == tmp_path and path.name.startswith("kvtier-h")
    assert region_path(tmp_path, "9524e105-ddaa_dp0", 1).name == "kvtier-9524e105-ddaa_dp0-r1.pool"


def test_a_live_engines_file_is_never_taken_over(tmp_path):
    Region.create(tmp_path, _info())
    with pytest.raises(RegionError, match="belongs to a live engine"):
        Region.create(tmp_path, _info())


def test_files_of_dead_creators_are_swept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    live = Region.create(tmp_path, _info(engine="here"))
    stale = Region.create(tmp_path, _info(engine="gone", pid=int(dead.stdout)))
    assert sweep_stale(tmp_path) == [stale.path] and live.path.exists()
    again = Region.create(tmp_path, _info(engine="gone", pid=int(dead.stdout)))  # the name is free again
    Region.create(tmp_path, _info(engine="next"))  # every new file sweeps first
    assert not again.path.exists() and live.path.exists()


def test_too_little_shared_memory_fails_before_anything_is_created(tmp_path, monkeypatch):
    monkeypatch.setattr(regions, "_free_bytes", lambda d: 1 << 20)
    with pytest.raises(RegionError, match="needs .* bytes in .* which has 1048576 free; lower host_bytes"):
        Region.create(tmp_path, _info(pages=4096))
    assert list(tmp_path.iterdir()) == []


def test_a_missing_directory_is_named():
    with pytest.raises(RegionError, match="host_dir /no/such/dir is not a directory"):
        Region.create("/no/such/dir", _info())
