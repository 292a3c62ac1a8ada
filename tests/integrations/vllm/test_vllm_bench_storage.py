"""``kvtier bench storage`` beside vLLM's own ``fs`` tier: where vLLM is installed, its
batch functions move the same pages, buffered and with O_DIRECT, in the same run, and
every byte they read back is the bytes they wrote."""

import math

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.fs.io")

from kvtier.bench import storage as bench  # noqa: E402
from kvtier.bench.storage_peers import VllmFsTier, vllm_fs_io  # noqa: E402


def test_rows_for_vllm_fs_tier_share_kvtiers_figures(tmp_path):
    out = bench.run(layers=2, heads=2, head_dim=64, page_size=16, pages=4, backends=("file",),
                    directory=str(tmp_path), repeat=1, io_threads=2)
    rows = {(r["backend"], r["op"]): r for r in out["rows"]}
    peers = sorted({b for b, _ in rows if b.startswith("file vs vllm fs")})
    assert "file vs vllm fs buffered" in peers and set(out["skipped"]) <= {"vllm fs o_direct"}
    for peer in peers:
        for op in ("put", "get", "cold get"):
            row = rows[(peer, op)]
            assert row["kvtier_gbps"] == rows[("file", op)]["kvtier_gbps"]  # the same kvtier timing
            assert math.isclose(row["ratio"], row["kvtier_gbps"] / row["raw_gbps"], rel_tol=1e-9)
            assert row["kvtier_median_gbps"] == rows[("file", op)]["kvtier_median_gbps"]


@pytest.mark.parametrize("o_direct", [False, True])
def test_the_peer_client_moves_real_bytes(tmp_path, o_direct):
    io = vllm_fs_io()
    if o_direct and not VllmFsTier.available(io, tmp_path / "probe"):
        pytest.skip("O_DIRECT does not work here")
    tier = VllmFsTier(io, tmp_path / "fs", 8, 8192, 2, o_direct)
    tier.clear()
    tier.buf[:] = np.arange(tier.buf.size) % 251
    want = tier.buf.copy()
    tier.put()
    tier.buf[:] = 0
    tier.get()
    assert (tier.buf == want).all()
    assert len(list((tmp_path / "fs").rglob("*.bin"))) == 8
