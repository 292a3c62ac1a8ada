"""kvtier behind vLLM's OpenAI server on hybrid models (tiny gpt-oss: a sliding window
group and a full attention group; tiny Gemma 3: 5 sliding groups and 1 full one), in
vLLM's default process layout (worker and engine core in processes of their own,
sharing kvtier's pool files in ``host_dir``): texts identical to a server without
offloading, host-tier hits after ``/reset_prefix_cache``, storage objects under a key
prefix of every KV cache group, storage hits in a fresh server, and no pool file left
in ``host_dir``."""

import re
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from kvtier.testing.checkpoints import prompt, save_hybrid  # noqa: E402
from kvtier.storage.pagefile import object_name  # noqa: E402
from tests.support.storage import object_files  # noqa: E402
from tests.support.vllm_server import Server  # noqa: E402

#: KV cache groups vLLM makes of each tiny model (sliding window 64: 2 blocks of 32).
GROUPS = {"gpt-oss": 2, "gemma3": 6}
PROMPTS = [prompt(200, offset=0), prompt(200, offset=1)]  # ~425 tokens each, far longer than the window
FULL_BLOCKS = 13 * 32  # the whole blocks of each prompt before its last token: what a hit can cover


@pytest.fixture(scope="module", params=sorted(GROUPS, reverse=True))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def work(family, tmp_path_factory):
    return tmp_path_factory.mktemp(f"hybrid-{family}")


@pytest.fixture(scope="module")
def model(family, work):
    return str(save_hybrid(work / "model", family))


@pytest.fixture(scope="module")
def reference(model, work):
    """Greedy texts of a server without kvtier."""
    server = Server(model, work / "reference.log").wait_ready()
    try:
        out = [server.complete(p) for p in PROMPTS]
    finally:
        server.stop()
    assert all(cached == 0 for _, cached in out)
    assert len(set(text for text, _ in out)) == 2  # the prompts' texts tell them apart
    return [text for text, _ in out]


def _kvtier(work: Path) -> dict:
    (work / "shm").mkdir(exist_ok=True)
    return {"host_bytes": 64 << 20, "storage": f"file://{work}/store", "host_dir": str(work / "shm")}


def _stored_keys(store: Path) -> Counter:
    """Keys in file storage by ``(key prefix, KV cache group)``: file storage hashes key
    names into its paths (a file per page and writer, in shard directories), but every object's
    header names its ``<key>#<field>``; kvtier's keys are ``<prefix>/<hex of vLLM's
    OffloadKey>``, whose last 4 bytes are the group's index."""
    keys = set()
    for path in object_files(store):
        if path.name.startswith("."):
            continue
        name = object_name(path.read_bytes()[:4096])
        assert name is not None, path
        keys.add(name.split("#")[0])
    return Counter((prefix, int(hex_key[-8:], 16)) for prefix, hex_key in (k.rsplit("/", 1) for k in keys))


def test_host_tier_serves_every_group_and_storage_holds_each_groups_blocks(family, model, work, reference):
    groups, shm = GROUPS[family], work / "shm"
    server = Server(model, work / "kvtier.log", kvtier=_kvtier(work)).wait_ready()
    try:
        log = server.log_text()
        for g in range(groups):  # each group's pool file, named by rank and group, made by the worker process
            name = re.escape(f"-r0{f'-g{g}' if g else ''}.pool")
            assert re.search(rf"\(Worker pid=\d+\).*kvtier: worker 0 of 1, KV cache group {g} of {groups}: "
                             rf".* in {re.escape(str(shm))}/kvtier-[^ ]*{name}", log), log[-3000:]
        assert re.search(rf"\(EngineCore pid=\d+\).*kvtier: host tier of {groups} group\(s\)", log), log[-3000:]
        assert list(shm.iterdir()) == []  # the engine core mapped the worker's files, then removed their names
        for p, want in zip(PROMPTS, reference):
            assert server.complete(p) == (want, 0)
        server.reset_prefix_cache()
        for p, want in zip(PROMPTS, reference):
            assert server.complete(p) == (want, FULL_BLOCKS)
        m = server.metrics()
        assert m['vllm:prompt_tokens_cached_by_source_total{source="host"}'] == 2 * FULL_BLOCKS
        assert m['vllm:prompt_tokens_cached_by_source_total{source="device"}'] == 0
        assert m['vllm:kv_offload_total_bytes_total{transfer_type="CPU_to_GPU"}'] > 0
        assert m['vllm:kv_offload_total_bytes_total{transfer_type="GPU_to_CPU"}'] > 0
        assert m['vllm:kv_offload_tiering_write_bytes_total{tier="file"}'] > 0
        assert m.get("vllm:kv_offload_allocation_failure_total", 0) == 0
    finally:
        server.stop()
    assert list(shm.iterdir()) == []

    stored = _stored_keys(work / "store")
    by_group = Counter()
    for (prefix, g), n in stored.items():
        by_group[g] += n
    assert sorted(by_group) == list(range(groups)), stored  # every group wrote its blocks
    prefixes = {prefix for prefix, _ in stored}
    assert len(prefixes) == groups and all(re.search(r"\.L[0-9a-f]{12}$", p) for p in prefixes), prefixes
    assert len({g for _, g in stored}) == len(stored)  # one prefix per group, one group per prefix
    # the full attention group holds each prompt's 13 whole blocks; a sliding window group
    # only the window before each prompt's resume point
    full = [g for g, n in by_group.items() if n == 2 * 13]
    assert len(full) == 1, by_group
    assert all(0 < n < 2 * 13 for g, n in by_group.items() if g != full[0]), by_group


def test_fresh_server_serves_every_group_from_storage(family, model, work, reference):
    shm = work / "shm"
    server = Server(model, work / "fresh.log", kvtier=_kvtier(work)).wait_ready()
    try:
        assert list(shm.iterdir()) == []
        for p, want in zip(PROMPTS, reference):
            assert server.complete(p) == (want, FULL_BLOCKS)
        m = server.metrics()
        assert m['vllm:prompt_tokens_cached_by_source_total{source="disk"}'] == 2 * FULL_BLOCKS
        assert m['vllm:kv_offload_tiering_read_bytes_total{tier="file"}'] > 0
        assert m['vllm:kv_offload_tiering_chunk_hits_total{tier="file"}'] >= 2 * 13
        assert m.get('vllm:kv_offload_tiering_promotion_job_failures_total{tier="file"}', 0) == 0
        server.reset_prefix_cache()  # read from storage into the host tier: now host hits
        assert server.complete(PROMPTS[0]) == (reference[0], FULL_BLOCKS)
        assert server.metrics()['vllm:prompt_tokens_cached_by_source_total{source="host"}'] == FULL_BLOCKS
    finally:
        server.stop()
    assert list(shm.iterdir()) == []
