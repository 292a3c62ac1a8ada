"""sglang's own HTTP server (``python -m sglang.launch_server`` on the CPU) serving a plain
model, a tiny random Llama (4 layers, 2 KV heads of 64, K and V alike), with HiCache
and kvtier as its ``dynamic`` L3 backend over a ``file://`` store. sglang gives it one KV
pool, with kvtier's host pool (``KVTIER_SGLANG_HOST_POOL=all``: sglang's own host pool
dies on CPU-only torch), and registers it through ``register_mem_pool_host`` (the v1
call) followed by ``on_host_pools_registered``; pages travel through the host pool's
flat pages (no ``interface_v1``).

Three servers, one after another: sglang alone (no hierarchical cache) for its greedy
texts; a kvtier one that fills the store and restores a flushed prompt from it; and a
new one on the same store, with a device pool too small for two prompts, that restores
a prompt from storage, then from its host tier once another prompt evicted it. Every
text equals sglang's own.

NOTE: only the ``sgl_kernel`` stand-in goes on the servers' ``PYTHONPATH``
(``sglang_server.write_standin``): the sliding-window fix has nothing to fix here.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt")

from kvtier.testing.checkpoints import prompt, save_llama  # noqa: E402
from tests.support.sglang_server import (FIXED, MAX_NEW, PAGE, Server, assert_clean, field_name, require_server_modules,  # noqa: E402
                                         stored_keys)
from tests.support.sglang_server import write_standin  # noqa: E402

#: ~360 tokens each, first pages all different (sglang's default prefetch_threshold is 256 tokens)
PROMPTS = {"a": prompt(170, 0), "b": prompt(170, 5), "c": prompt(170, 9)}
#: The one pool kvtier serves: 4 layers of 2 K heads and 2 V heads of 64, bfloat16.
SPEC = "L4-bf16-k=2x64-v=2x64"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    require_server_modules()
    return tmp_path_factory.mktemp("sglang-llama")


@pytest.fixture(scope="module")
def model(work):
    return save_llama(work / "llama", head_dim=64)


@pytest.fixture(scope="module")
def standin(work):
    return write_standin(work / "standin", swa_fix=False)


@pytest.fixture(scope="module")
def store(work):
    path = work / "store"
    path.mkdir()
    return path


#: What the servers saw, for the tests after them (they run in file order).
SEEN: dict = {}


def needs(*keys: str) -> None:
    if not all(k in SEEN for k in keys):
        pytest.skip(f"needs the earlier tests ({', '.join(keys)})")


def assert_serves_the_kv_pool(log: str) -> None:
    assert FIXED not in log
    assert "hybrid_swa=False" in log and "hicache_attached=True" in log
    assert "kvtier took over sglang's host pool MHATokenToKVPoolHost: KVTierMHAHostPool" in log
    bound = [line for line in log.splitlines() if "kvtier storage file bound to sglang pool" in line]
    assert len(bound) == 1 and f"bound to sglang pool kv: spec {SPEC}, shard 0/1, page_size {PAGE}" in bound[0], bound
    served = [line for line in log.splitlines() if "kvtier storage serves sglang host pools:" in line]
    assert len(served) == 1 and served[0].endswith(f"kvtier storage serves sglang host pools: kv ({SPEC}, "
                                                   "KVTierMHAHostPool)"), served
    assert_clean(log)


def test_sglang_alone_gives_the_reference_texts(model, standin, work):
    """Without the hierarchical cache (and without kvtier): each prompt's greedy text,
    the same again from sglang's device cache."""
    server = Server(model, None, standin, work / "reference.log", max_total_tokens=2048).wait_ready()
    try:
        texts = {}
        for name, text in PROMPTS.items():
            cold = server.generate(text)
            assert cold.cached == 0 and cold.prompt_tokens > 256 + PAGE
            texts[name] = cold.text
        again = server.generate(PROMPTS["a"])
        assert (again.cached, again.device, again.host, again.storage) == (again.full_pages, again.full_pages, 0, 0)
        assert again.text == texts["a"]
        log = server.log_text()
    finally:
        server.stop()
    assert len(set(texts.values())) == len(texts), texts  # the random model's texts depend on the prompt
    assert "'enable_hierarchical_cache': False" in log and "hicache_attached=False" in log and "kvtier" not in log
    assert_clean(log)
    SEEN["texts"] = texts


def test_a_flushed_prompt_comes_back_from_storage(model, store, standin, work):
    """kvtier serves sglang's one KV pool; cold texts are sglang's own; after
    ``/flush_cache`` a prompt's whole pages come from storage, with the same text."""
    needs("texts")
    texts = SEEN["texts"]
    server = Server(model, store, standin, work / "first.log", max_total_tokens=2048).wait_ready()
    try:
        assert_serves_the_kv_pool(server.log_text())
        server.flush()  # the warm-up request's pages stored (two pages of 29 + 8 tokens)
        before = set(stored_keys(store))
        cold = server.generate(PROMPTS["a"])
        assert cold.cached == 0 and cold.text == texts["a"]
        device = server.generate(PROMPTS["a"])
        assert (device.cached, device.device, device.host, device.storage) == \
            (device.full_pages, device.full_pages, 0, 0)
        assert device.text == texts["a"]
        server.flush()  # device and host emptied, storage writes done
        restored = server.generate(PROMPTS["a"])
        assert (restored.cached, restored.device, restored.host, restored.storage) == \
            (restored.full_pages, 0, 0, restored.full_pages)
        assert restored.text == texts["a"]
        b = server.generate(PROMPTS["b"])
        assert b.cached == 0 and b.text == texts["b"]
        server.flush()
        keys = {k: v for k, v in stored_keys(store).items() if k not in before}
        # an object per whole page of each prompt and its answer (less the last token): one file, both KV heads
        pages = sum((p.prompt_tokens + MAX_NEW - 1) // PAGE for p in (cold, b))
        assert len(keys) == pages, (len(keys), pages)
        assert all("~" not in k and [field_name(f) for f in files] == [f"{SPEC}.p{PAGE}.g0-2of2"]
                   for k, files in keys.items()), sorted(keys.items())[:2]
        assert_clean(server.log_text())
    finally:
        server.stop()
    SEEN["stored"] = set(keys)


def test_a_new_server_restores_from_storage_then_from_host(model, store, standin, work):
    """Same store, a device pool of 512 tokens (two prompts do not fit): a prompt the
    first server stored comes back from storage; evicted by a new prompt, from host; the
    other stored prompt from storage; every text sglang's own."""
    needs("texts", "stored")
    texts = SEEN["texts"]
    server = Server(model, store, standin, work / "second.log", max_total_tokens=512).wait_ready()
    try:
        assert_serves_the_kv_pool(server.log_text())
        a = server.generate(PROMPTS["a"])
        assert (a.cached, a.device, a.host, a.storage) == (a.full_pages, 0, 0, a.full_pages)
        assert a.text == texts["a"]
        c = server.generate(PROMPTS["c"])  # never stored: computed, taking A's device pages
        assert (c.cached, c.storage) == (0, 0)
        assert c.text == texts["c"]
        again = server.generate(PROMPTS["a"])
        assert (again.cached, again.device, again.host, again.storage) == (a.full_pages, 0, a.full_pages, 0)
        assert again.text == texts["a"]
        b = server.generate(PROMPTS["b"])  # stored by the first server, evicting A again
        assert (b.cached, b.device, b.host, b.storage) == (b.full_pages, 0, 0, b.full_pages)
        assert b.text == texts["b"]
        server.flush()
        assert set(stored_keys(store)) >= SEEN["stored"]
        assert_clean(server.log_text())
    finally:
        server.stop()
