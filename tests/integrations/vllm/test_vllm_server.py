"""kvtier behind vLLM's OpenAI server as operators run it (``vllm serve``'s module, on
vLLM's CPU build, tiny random-weight checkpoints), in vLLM's default process layout
and in the in-process one, at tensor-parallel sizes 1 and 2: host-tier hits after
``/reset_prefix_cache``, storage hits in a new server, texts identical to a server
without offloading of the same TP size (and of the other size, where this machine's
TP 1 and TP 2 compute the same texts: see ``reference_tp2``), kvtier's hits in
vLLM's metrics, and a misspelled key that refuses to start on one clear line."""

import re
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from kvtier.testing.checkpoints import prompt, save_llama  # noqa: E402
from tests.support.vllm_server import Server  # noqa: E402

PROMPTS = [prompt(300, offset=0), prompt(300, offset=5)]  # ~620 tokens each: 19 full blocks of 32
FULL_BLOCKS = 19 * 32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(save_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="module")
def reference(model, work):
    """Texts of a server without offloading."""
    server = Server(model, work / "reference.log").wait_ready()
    try:
        return [server.complete(p)[0] for p in PROMPTS]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference_tp2(model, work):
    """Texts of a tensor-parallel 2 server without offloading. They equal ``reference``'s
    where this machine's TP 1 and TP 2 compute alike (the Xeon VMs); on an AVX2-only
    EPYC VM they differ with no cache at all, so there KV that one TP size computed
    gives the other size a text of its own, right KV or not."""
    server = Server(model, work / "reference-tp2.log", tp=2).wait_ready(400)
    try:
        return [server.complete(p)[0] for p in PROMPTS]
    finally:
        server.stop()


def _across_tp(text: str, want: str, same: bool) -> None:
    """A text from KV the other TP size computed: ``want`` where both sizes compute alike."""
    if same:
        assert text == want


def _kvtier(work, **extra):
    return {"host_bytes": 64 << 20, "storage": f"file://{work}/store", **extra}


def _pool_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("kvtier-*.pool")} if Path("/dev/shm").is_dir() else set()


def test_default_layout_serves_from_the_host_tier_and_writes_storage(model, work, reference):
    before = _pool_files()
    server = Server(model, work / "default.log", kvtier=_kvtier(work), cli=True).wait_ready()  # `vllm serve`
    try:
        log = server.log_text()
        assert re.search(r"\(Worker pid=\d+\).*kvtier: worker 0 of 1", log), log[-3000:]
        assert re.search(r"\(EngineCore pid=\d+\).*kvtier: host tier of \d+ offloaded blocks", log), log[-3000:]
        assert _pool_files() == before  # the scheduler mapped the worker's file, then removed its name
        cold = server.complete(PROMPTS[0])
        assert cold == (reference[0], 0)
        server.reset_prefix_cache()
        text, cached = server.complete(PROMPTS[0])
        assert text == reference[0] and cached == FULL_BLOCKS
        m = server.metrics()
        assert m['vllm:prompt_tokens_cached_by_source_total{source="host"}'] == FULL_BLOCKS
        assert m['vllm:kv_offload_total_bytes_total{transfer_type="CPU_to_GPU"}'] > 0
        assert m['vllm:kv_offload_total_bytes_total{transfer_type="GPU_to_CPU"}'] > 0
        assert m["vllm:kv_offload_cpu_cache_usage_perc"] > 0
        assert m['vllm:kv_offload_tiering_write_bytes_total{tier="file"}'] > 0
        assert m.get("vllm:kv_offload_allocation_failure_total", 0) == 0
    finally:
        server.stop()
    assert any(p.is_file() for p in (work / "store").rglob("*"))


def test_tensor_parallel_2_reads_tp1_pages_serves_host_hits_and_writes_its_own(model, work, reference,
                                                                             reference_tp2):
    same = reference_tp2 == reference
    server = Server(model, work / "tp2.log", kvtier=_kvtier(work), tp=2).wait_ready(400)
    try:
        assert "kvtier: worker 1 of 2" in server.log_text()
        text, cached = server.complete(PROMPTS[0])  # stored by the TP 1 server above
        _across_tp(text, reference[0], same)
        assert cached == FULL_BLOCKS
        assert server.complete(PROMPTS[1]) == (reference_tp2[1], 0)
        server.reset_prefix_cache()
        text, cached = server.complete(PROMPTS[0])
        _across_tp(text, reference[0], same)
        assert cached == FULL_BLOCKS
        assert server.complete(PROMPTS[1]) == (reference_tp2[1], FULL_BLOCKS)  # its own pages, from the host
        m = server.metrics()
        assert m['vllm:prompt_tokens_cached_by_source_total{source="disk"}'] == FULL_BLOCKS
        assert m['vllm:prompt_tokens_cached_by_source_total{source="host"}'] == 2 * FULL_BLOCKS
    finally:
        server.stop()


def test_in_process_layout_reads_tp2_pages_from_storage(model, work, reference, reference_tp2):
    server = Server(model, work / "in-process.log", kvtier=_kvtier(work), layout="in-process").wait_ready()
    try:
        assert re.search(r"\(EngineCore pid=\d+\).*kvtier: worker 0 of 1", server.log_text())
        assert server.complete(PROMPTS[0]) == (reference[0], FULL_BLOCKS)
        text, cached = server.complete(PROMPTS[1])  # its pages were written at TP 2
        _across_tp(text, reference[1], reference_tp2 == reference)
        assert cached == FULL_BLOCKS
        m = server.metrics()
        assert m['vllm:prompt_tokens_cached_by_source_total{source="disk"}'] == 2 * FULL_BLOCKS
        assert m['vllm:kv_offload_tiering_read_bytes_total{tier="file"}'] > 0
        assert m['vllm:kv_offload_tiering_chunk_hits_total{tier="file"}'] == 2 * 19
        assert m['vllm:kv_offload_tiering_lookup_async_delay_seconds_count{tier="file"}'] >= 1
        server.reset_prefix_cache()
        assert server.complete(PROMPTS[0]) == (reference[0], FULL_BLOCKS)
        assert server.metrics()['vllm:prompt_tokens_cached_by_source_total{source="host"}'] == FULL_BLOCKS
    finally:
        server.stop()


def test_misspelled_key_refuses_to_start_on_one_clear_line(model, work):
    server = Server(model, work / "typo.log", kvtier={"host_byte": 64 << 20}, layout="in-process")
    assert server.wait_exit() != 0
    lines = [line for line in server.log_text().splitlines() if "kvtier: unknown kv_connector_extra_config" in line]
    assert lines, server.log_text()[-3000:]
    assert "'host_byte': did you mean 'host_bytes'?" in lines[0]
