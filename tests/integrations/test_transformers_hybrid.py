"""Sliding-window and hybrid Hugging Face models through kvtier: the groups come from the
cache and the config, reuse from every tier in every host layout leaves greedy outputs
and first-token logits as without kvtier, and a wrongly restored window would show."""

import random
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import kvtier.storage  # noqa: E402
from kvtier.hybrid import HybridSpec  # noqa: E402
from kvtier.integrations.transformers import (  # noqa: E402
    CachedGenerator, UnsupportedModelError, _forward, _new_cache, generate_uncached, spec_from_model)
from tests.support.transformers_models import FAMILIES, WINDOW, build, sliding_layers  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
PAGE = 8


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, build(request.param, seed=3)


def reference(net, prompt, n):
    out, _ = generate_uncached(net, prompt, max_new_tokens=n)
    logits = _forward(net, torch.tensor([prompt]), _new_cache(net)).logits[0, -1]
    return out, logits


def check(net, gen, prompt, n=4):
    got = gen.generate(prompt, max_new_tokens=n)
    want, logits = reference(net, prompt, n)
    assert got.output == want
    assert torch.allclose(got.first_logits, logits, atol=1e-5, rtol=0), (got.first_logits - logits).abs().max()
    return got


def test_groups_come_from_the_cache_and_the_config(family):
    name, net = family
    spec = spec_from_model(net)
    assert isinstance(spec, HybridSpec)
    sliding = [layer for g in spec.groups if not g.attention.is_full for layer in g.layers]
    assert sorted(sliding) == sliding_layers(net)
    assert {g.attention.window for g in spec.groups if not g.attention.is_full} == {WINDOW}
    if name == "mimo":  # twice the KV heads on the sliding layers, K 24 / V 16 on both
        heads = {g.attention.kind: (g.spec.component("k").head_num, g.spec.component("k").head_dim,
                                    g.spec.component("v").head_dim) for g in spec.groups}
        assert heads == {"full": (1, 24, 16), "sliding": (2, 24, 16)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sessions_reuse_every_tier_and_change_nothing(family, layout, tmp_path):
    """Two sessions over one system prompt, two turns each; then the host, then storage."""
    _, net = family
    store = kvtier.storage.open(f"file://{tmp_path}")
    gen = CachedGenerator.build(net, device_tokens=512, host_tokens=1024, page_size=PAGE, storage=store,
                                layout=layout, retention_interval=32)
    rng = random.Random(1)
    system = [rng.randrange(256) for _ in range(40)]
    hits = []
    for _ in range(2):
        history = system + [rng.randrange(256) for _ in range(12)]
        for _ in range(2):
            r = check(net, gen, history)
            hits.append(r.device_tokens)
            history = history + r.output + [rng.randrange(256) for _ in range(10)]
    assert hits[0] == 0 and hits[1] >= 48  # the session's own turn
    assert hits[2] >= 32  # the shared system prompt, from its retention point
    gen.cache.flush()
    gen.cache.evict_device(10 ** 6)
    r = check(net, gen, history)
    assert r.device_tokens == 0 and r.host_tokens >= 48
    gen.cache.flush()
    fresh = CachedGenerator.build(net, device_tokens=512, host_tokens=1024, page_size=PAGE, storage=store,
                                  layout=layout, retention_interval=32)
    r = check(net, fresh, history)
    assert r.device_tokens == r.host_tokens == 0 and r.storage_tokens >= 48
    assert gen.cache.stats()["errors"] == fresh.cache.stats()["errors"] == 0
    gen.cache.close()
    fresh.cache.close()


def test_sliding_groups_keep_only_windows():
    net = build("mimo", seed=3)
    gen = CachedGenerator.build(net, device_tokens=512, host_tokens=512, page_size=PAGE)
    prompt = [random.Random(2).randrange(256) for _ in range(100)]
    r = check(net, gen, prompt)
    gen.cache.flush()
    full = (len(prompt) + len(r.output) - 1) // PAGE  # the pages committed
    # the window of 16 before the end: 2 or 3 pages of 8, not the `full` pages the layers computed
    assert cache_pages(gen) <= 3 < full
    gen.cache.close()


def cache_pages(gen) -> int:
    return gen.cache.stats()["sliding_pages"]["swa"]["device"]


@pytest.mark.parametrize("wrong", ["one token short", "cumulative length unset"])
def test_a_wrongly_restored_window_changes_the_outputs(wrong):
    """What the tests guard against is visible: restoring the sliding layers one token
    short, or without their cumulative length, either makes the model refuse the
    window (its mask is sized from that length) or changes the first-token logits."""
    net = build("mimo", seed=3)
    gen = CachedGenerator.build(net, device_tokens=512, host_tokens=512, page_size=PAGE)
    prompt = [random.Random(3).randrange(256) for _ in range(60)]
    check(net, gen, prompt)
    right = gen._to_dynamic

    def broken(got):
        dyn = right(got)
        for layer in dyn.layers:
            if getattr(layer, "is_sliding", False):
                if wrong == "one token short":
                    layer.keys, layer.values = layer.keys[:, :, 1:], layer.values[:, :, 1:]
                else:  # as when keys and values are assigned without update(): never counted
                    layer.cumulative_length = 0
        return dyn

    longer = prompt + [1, 2, 3, 4, 5]
    _, want = reference(net, longer, 1)
    got = gen.cache.acquire(longer[:-1])
    reused = got.device_indices.numel()
    assert reused >= 56
    ok = _forward(net, torch.tensor([longer[reused:]]), right(got)).logits[0, -1]
    assert torch.allclose(ok, want, atol=1e-5, rtol=0)  # the right restore, by the same path
    try:
        bad = _forward(net, torch.tensor([longer[reused:]]), broken(got)).logits[0, -1]
    except RuntimeError as e:  # the mask, sized from the cumulative length, no longer fits the window
        assert "size" in str(e)
    else:  # or it fits a wrong window: then the logits are wrong
        assert not torch.allclose(bad, want, atol=1e-3, rtol=0)
    gen.cache.release(got)
    gen.cache.close()


def test_only_state_kvtier_cannot_page_is_refused_by_name():
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    cfg = Qwen3NextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_value_heads=2,
                          linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                          moe_intermediate_size=16, num_experts=2, num_experts_per_tok=1,
                          shared_expert_intermediate_size=16)
    with pytest.raises(UnsupportedModelError, match="LinearAttentionLayer"):
        spec_from_model(AutoModelForCausalLM.from_config(cfg).eval())


@pytest.mark.parametrize("name", ["mimo", "gemma3", "mistral"])
def test_model_generate_with_kvtier_underneath_samples_as_without(name):
    """``hf_generate`` is ``model.generate`` (sampling, top-k, a fixed seed) over a restored
    prefix: the same tokens as plain ``model.generate``, cold and with hits; a prompt
    sent again is a hit."""
    net = build(name, seed=3)
    gen = CachedGenerator.build(net, device_tokens=512, host_tokens=512, page_size=PAGE)
    prompt = torch.tensor([[random.Random(4).randrange(256) for _ in range(60)]])
    for kw in (dict(do_sample=True, top_k=20, temperature=0.9), dict(do_sample=False)):
        torch.manual_seed(0)
        want = net.generate(prompt, max_new_tokens=8, pad_token_id=0, **kw)
        for _ in range(2):
            before = gen.cache.stats()["device_hit_tokens"]
            torch.manual_seed(0)
            got = gen.hf_generate(prompt, max_new_tokens=8, pad_token_id=0, **kw)
            assert torch.equal(got, want)
        assert gen.cache.stats()["device_hit_tokens"] - before == 56  # the repeat resumed after 56 tokens
    with pytest.raises(ValueError, match="batch 1"):
        gen.hf_generate(torch.zeros(2, 8, dtype=torch.long), max_new_tokens=1)
    gen.cache.close()
