"""sglang's own HTTP server (``python -m sglang.launch_server`` on the CPU) serving a
sliding-window model, with HiCache and kvtier as its ``dynamic`` L3 backend over a
``file://`` store: a tiny random Mellum (JetBrains' Qwen3-MoE variant, ``model_type``
``mellum``, ``MellumForCausalLM``; every MLP dense) whose layers mix sliding (a 64-token
window, 4 pages of 16) and full attention. sglang gives it hybrid SWA pools: a full KV
pool and a sliding one, each with a kvtier host pool (``KVTIER_SGLANG_HOST_POOL=all``:
sglang's own host pool dies on CPU-only torch), which it registers with kvtier through
the v2 interface (``register_mem_host_pool_v2``, ``batch_exists_v2`` with the sliding
pool's ``TRAILING_PAGES``, ``batch_get_v2``/``batch_set_v2``).

Two servers: the first fills the store and restores a flushed prompt from it; the
second, on the same store with a device pool too small for two prompts, restores it
from storage, then from its host tier once another prompt evicted it.

NOTE: two stand-ins go on the servers' ``PYTHONPATH`` (``sglang_server.write_standin``),
besides the torchvision one: ``sgl_kernel`` (no CPU wheel here; only the two functions
sglang's CPU path calls are real) and a
``sitecustomize`` that fixes one sglang 0.5.23 bug on this path: its ``torch_native``
attention backend writes a sliding layer's K/V at the SWA pool's slots
(``translate_loc_from_full_to_swa``) but reads them back at the full pool's slots
(``k_cache[req_to_token[...]]`` with ``get_key_buffer`` the SWA buffer), so sliding
layers attend to whatever those SWA slots hold and sglang's own text depends on the
allocators' history (a cold prefill and a prefix hit differ, with or without kvtier).
The fix reads through the translated slots, as sglang's ``intel_amx`` backend does
(``_swa_kv_indices``); then the restored sliding pages decide the text, and a prompt's
text is the same cold, from the device, host or storage.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sglang.srt")

from kvtier.testing.checkpoints import prompt  # noqa: E402
from tests.support.sglang_server import (FIXED, MAX_NEW, PAGE, Server, assert_clean, require_server_modules,  # noqa: E402
                                         field_name, stored_keys, write_standin)

WINDOW = 64
LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
#: ~360 tokens each, first pages all different (sglang's default prefetch_threshold is 256 tokens)
PROMPT_A, PROMPT_B, PROMPT_C = prompt(170, 0), prompt(170, 5), prompt(170, 9)


def save_mellum(path: Path) -> Path:
    """A tiny random Mellum with the offline tokenizer of kvtier's tiny vLLM models."""
    from transformers import MellumConfig

    from kvtier.testing.checkpoints import common_config, save_checkpoint

    def config(vocab):
        return MellumConfig(**common_config(vocab, 256, len(LAYERS)), num_attention_heads=8, num_key_value_heads=2,
                            head_dim=64, sliding_window=WINDOW, layer_types=LAYERS,
                            mlp_layer_types=["dense"] * len(LAYERS), num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=128, architectures=["MellumForCausalLM"])
    return save_checkpoint(path, config)


def assert_serves_both_pools(log: str) -> None:
    assert FIXED in log
    assert "Use sliding window memory pool" in log and "hicache_attached=True" in log
    assert "kvtier storage file bound to sglang pool kv:" in log
    assert "kvtier storage file bound to sglang pool swa:" in log
    served = [line for line in log.splitlines() if "kvtier storage serves sglang host pools:" in line]
    assert len(served) == 1, served
    # the full pool has the one full layer, the sliding one the three sliding layers
    assert "kv (L1-bf16-k=2x64-v=2x64, KVTierMHAHostPool), swa (L3-bf16-k=2x64-v=2x64, KVTierMHAHostPool)" \
        in served[0], served
    assert_clean(log)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    require_server_modules()
    return tmp_path_factory.mktemp("sglang-hybrid")


@pytest.fixture(scope="module")
def model(work):
    return save_mellum(work / "mellum")


@pytest.fixture(scope="module")
def standin(work):
    return write_standin(work / "standin")


@pytest.fixture(scope="module")
def store(work):
    path = work / "store"
    path.mkdir()
    return path


#: What the first server saw, for the tests after it (they run in file order).
SEEN: dict = {}


@pytest.fixture(scope="module")
def first(model, store, standin, work):
    server = Server(model, store, standin, work / "first.log", max_total_tokens=2048).wait_ready()
    yield server
    server.stop()


def test_kvtier_serves_both_pools_and_a_flushed_prompt_comes_back_from_storage(first, store):
    """kvtier is bound to both of sglang's host pools; after ``/flush_cache`` a prompt's
    whole pages come from storage, and its text is the one sglang gave from the device."""
    assert_serves_both_pools(first.log_text())
    cold = first.generate(PROMPT_A)
    assert cold.cached == 0 and cold.prompt_tokens > 256 + PAGE
    device = first.generate(PROMPT_A)
    assert (device.cached, device.device, device.host, device.storage) == (device.full_pages, device.full_pages, 0, 0)
    assert cold.text == device.text  # sliding layers read what they wrote (the fix): one text
    first.flush()  # device and host emptied, storage writes done
    restored = first.generate(PROMPT_A)
    assert (restored.cached, restored.device, restored.host, restored.storage) == \
        (restored.full_pages, 0, 0, restored.full_pages)
    assert restored.text == device.text
    # C's objects alone: for the next server, which finds them without their ~swa objects
    first.flush()
    before = set(stored_keys(store))
    c = first.generate(PROMPT_C)
    assert c.cached == 0
    first.flush()
    SEEN.update(text=device.text, c_text=c.text, c_pages=(c.prompt_tokens + MAX_NEW - 1) // PAGE,
                c_keys=set(stored_keys(store)) - before)
    assert_clean(first.log_text())


def test_storage_holds_sliding_pages_beside_full_ones(first, store):
    """The SWA pool's pages are objects of their own (``<page hash>~swa``, the sliding
    layers' geometry), for the pages of the window before a prompt's end only."""
    if not SEEN:
        pytest.skip("needs the first server's test")
    keys = stored_keys(store)
    swa = {k for k in keys if k.endswith("~swa")}
    kv = set(keys) - swa
    assert swa and kv and len(swa) < len(kv), (len(swa), len(kv))
    assert {k[:-len("~swa")] for k in swa} <= kv  # a sliding page is a page of the full pool too
    assert all(field_name(p).startswith("L3-") for k in swa for p in keys[k])
    assert all(field_name(p).startswith("L1-") for k in kv for p in keys[k])
    # C alone: a KV object for each whole page of its prompt and answer; ~swa objects
    # for the window before each stored node's end only (the prompt's node and the
    # answer's: 4 or 5 pages of 16 tokens)
    c_swa = {k for k in SEEN["c_keys"] if k.endswith("~swa")}
    assert len(SEEN["c_keys"] - c_swa) == SEEN["c_pages"]
    assert WINDOW // PAGE <= len(c_swa) <= WINDOW // PAGE + 2, sorted(c_swa)


def test_a_new_server_restores_from_storage_then_from_host(model, store, standin, work, first):
    """Same store, a device pool of 512 tokens (two prompts do not fit): the prompt the
    first server stored comes back from storage, then, evicted by another, from host;
    a prompt whose sliding pages were removed gets no storage hit (sglang asks for the
    trailing window; kvtier never answers a prefix it cannot restore whole)."""
    if not SEEN:
        pytest.skip("needs the first server's test")
    first.stop()
    stored = stored_keys(store)
    for key in SEEN["c_keys"]:
        if key.endswith("~swa"):
            for path in stored[key]:
                path.unlink()
    server = Server(model, store, standin, work / "second.log", max_total_tokens=512).wait_ready()
    try:
        assert_serves_both_pools(server.log_text())
        c = server.generate(PROMPT_C)
        assert (c.cached, c.storage) == (0, 0)
        assert c.text == SEEN["c_text"]
        a = server.generate(PROMPT_A)
        assert (a.cached, a.device, a.host, a.storage) == (a.full_pages, 0, 0, a.full_pages)
        assert a.text == SEEN["text"]
        b = server.generate(PROMPT_B)
        assert b.cached == 0
        again = server.generate(PROMPT_A)  # B took A's device pages: A's come from host
        assert (again.cached, again.device, again.host, again.storage) == (a.full_pages, 0, a.full_pages, 0)
        assert again.text == SEEN["text"]
        assert_clean(server.log_text())
    finally:
        server.stop()
