"""Reused KV changes nothing: greedy outputs and first-token logits equal running without kvtier,
for MiMo-V2-Flash (K 48 / V 32), Llama GQA and DeepSeek-V3 (MLA latents), hits from every tier."""

import warnings

import pytest
import torch

pytest.importorskip("transformers")

import kvtier.storage  # noqa: E402
from kvtier.integrations.tiny_models import build  # noqa: E402
from kvtier.integrations.transformers import (  # noqa: E402
    CachedGenerator, UnsupportedModelError, _forward, _new_cache, generate_uncached, spec_from_model)

warnings.filterwarnings("ignore", category=FutureWarning)
MODELS = {"mimo": "L2-fp32-k=2x48-v=2x32", "llama": "L2-fp32-k=2x32-v=2x32", "deepseek": "L2-fp32-k=1x64-v=1x16"}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return request.param, build(request.param, layers=2, hidden=64, vocab=256, seed=1)


def reference(net, prompt, n):
    out, _ = generate_uncached(net, prompt, max_new_tokens=n)
    logits = _forward(net, torch.tensor([prompt]), _new_cache(net)).logits[0, -1]
    return out, logits


def check(net, gen, prompt, n=6):
    got = gen.generate(prompt, max_new_tokens=n)
    want, logits = reference(net, prompt, n)
    assert got.output == want
    assert torch.allclose(got.first_logits, logits, atol=1e-5, rtol=0), (got.first_logits - logits).abs().max()
    return got


def test_spec_is_read_off_the_cache_tensors(model):
    name, net = model
    assert spec_from_model(net).fingerprint() == MODELS[name]


def test_hits_from_each_tier_leave_outputs_unchanged(model, tmp_path):
    name, net = model
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 256, (70,), generator=g).tolist()
    store = kvtier.storage.open(f"file://{tmp_path}")
    gen = CachedGenerator.build(net, device_tokens=256, host_tokens=256, page_size=8, storage=store)
    first = check(net, gen, prompt)
    assert (first.device_tokens, first.host_tokens, first.storage_tokens) == (0, 0, 0)
    longer = prompt + first.output + torch.randint(0, 256, (20,), generator=g).tolist()
    r = check(net, gen, longer)
    assert r.device_tokens >= 64 and r.prefill_tokens < len(longer)          # device hit
    gen.cache.flush()
    gen.cache.evict_device(10_000)
    r = check(net, gen, longer)
    assert r.device_tokens == 0 and r.host_tokens >= 64                       # host hit, loaded back
    gen.cache.flush()
    fresh = CachedGenerator.build(net, device_tokens=256, host_tokens=256, page_size=8, storage=store)
    r = check(net, fresh, longer)
    assert r.device_tokens == 0 and r.host_tokens == 0 and r.storage_tokens >= 64   # storage hit
    gen.cache.close()
    fresh.cache.close()


def test_sliding_window_layers_are_refused_with_a_named_error():
    from transformers import AutoModelForCausalLM, MiMoV2FlashConfig

    cfg = MiMoV2FlashConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=12, v_head_dim=8,
                            moe_intermediate_size=16, n_routed_experts=2, num_experts_per_tok=1,
                            layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(UnsupportedModelError, match="full attention"):
        spec_from_model(AutoModelForCausalLM.from_config(cfg).eval())
