"""Reused KV changes nothing: greedy outputs and first-token logits equal running without kvtier,
for MiMo-V2-Flash with full attention only (K 48 / V 32), Llama GQA and DeepSeek-V3 (MLA latents),
hits from every tier."""

import warnings

import pytest
import torch

pytest.importorskip("transformers")

import kvtier.storage  # noqa: E402
from kvtier.integrations.transformers import (  # noqa: E402
    CachedGenerator, _forward, _new_cache, generate_uncached, spec_from_model)
from kvtier.tiny_models import build  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)
MODELS = {"mimo-full": "L2-fp32-k=2x48-v=2x32", "llama": "L2-fp32-k=2x32-v=2x32", "deepseek": "L2-fp32-k=1x64-v=1x16"}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return request.param, build(request.param, layers=2, hidden=64, vocab=256, seed=1)


def reference(net, prompt, n):
    out, _ = generate_uncached(net, prompt, max_new_tokens=n)
    logits = _forward(net, torch.tensor([prompt], device=net.device), _new_cache(net)).logits[0, -1]
    return out, logits


def check(net, gen, prompt, n=6, atol=1e-5):
    got = gen.generate(prompt, max_new_tokens=n)
    want, logits = reference(net, prompt, n)
    assert got.output == want
    assert torch.allclose(got.first_logits, logits, atol=atol, rtol=0), (got.first_logits - logits).abs().max()
    return got


def test_spec_is_read_off_the_cache_tensors(model):
    name, net = model
    assert spec_from_model(net).fingerprint() == MODELS[name]


def test_hits_from_each_tier_leave_outputs_unchanged(model, tmp_path):
    check_every_tier(model[1], tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_device_pool_and_pinned_host_pool(tmp_path):
    """The model, the device pool and the computation on the GPU; the host pool pinned."""
    net = build("mimo", layers=2, hidden=64, vocab=256, seed=1, device="cuda")
    # NOTE: GPU kernels are chosen by shape, so prefilling only the missing tokens may round
    # unlike the whole prompt's prefill: logits are compared more loosely, tokens exactly.
    gen = check_every_tier(net, tmp_path, atol=1e-4)
    assert gen.cache.device_pool.device.type == "cuda"
    assert gen.cache.host_pool.raw.is_pinned()


def test_tiny_models_are_built_on_the_device_asked_for():
    net = build("llama", layers=2, hidden=64, vocab=256, seed=1, device="cpu")
    same = build("llama", layers=2, hidden=64, vocab=256, seed=1)
    assert net.device.type == "cpu"
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), same.state_dict().values()))


def check_every_tier(net, tmp_path, atol=1e-5) -> CachedGenerator:
    """Hits from the device, the host (loaded back) and storage (prefetched), each checked
    against running without kvtier; returns the first generator, closed."""
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 256, (70,), generator=g).tolist()
    store = kvtier.storage.open(f"file://{tmp_path}")
    gen = CachedGenerator.build(net, device_tokens=256, host_tokens=256, page_size=8, storage=store)
    first = check(net, gen, prompt, atol=atol)
    assert (first.device_tokens, first.host_tokens, first.storage_tokens) == (0, 0, 0)
    longer = prompt + first.output + torch.randint(0, 256, (20,), generator=g).tolist()
    r = check(net, gen, longer, atol=atol)
    assert r.device_tokens >= 64 and r.prefill_tokens < len(longer)          # device hit
    gen.cache.flush()
    gen.cache.evict_device(10_000)
    r = check(net, gen, longer, atol=atol)
    assert r.device_tokens == 0 and r.host_tokens >= 64                       # host hit, loaded back
    gen.cache.flush()
    fresh = CachedGenerator.build(net, device_tokens=256, host_tokens=256, page_size=8, storage=store)
    r = check(net, fresh, longer, atol=atol)
    assert r.device_tokens == 0 and r.host_tokens == 0 and r.storage_tokens >= 64   # storage hit
    gen.cache.close()
    fresh.cache.close()
    return gen


def test_a_sliding_window_layer_makes_the_spec_hybrid():
    from transformers import AutoModelForCausalLM, MiMoV2FlashConfig

    from kvtier.hybrid import HybridSpec

    cfg = MiMoV2FlashConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=12, v_head_dim=8,
                            moe_intermediate_size=16, n_routed_experts=2, num_experts_per_tok=1,
                            layer_types=["full_attention", "sliding_attention"])
    spec = spec_from_model(AutoModelForCausalLM.from_config(cfg).eval())
    assert isinstance(spec, HybridSpec) and [g.attention.tag for g in spec.groups] == ["full", "swa128"]

@pytest.mark.parametrize("kw", [dict(num_beams=4, do_sample=False, early_stopping=False),
                                dict(do_sample=True, num_return_sequences=2, top_k=20)])
def test_a_search_of_several_rows_caches_the_prompt_only_and_its_reuse_is_exact(kw):
    """Beam search (and several returned sequences) keeps several rows of KV, and which
    row holds which returned sequence is the search's: only the prompt's pages, the same
    in every row, are cached. A prompt that continues the returned sequence then reuses
    the prompt and computes the rest, with the logits of a run without kvtier (before,
    row 0's KV was cached under ``sequences[0]``'s tokens: the logits differed)."""
    net = build("llama", layers=2, hidden=64, vocab=256, seed=1)
    gen = CachedGenerator.build(net, device_tokens=1024, host_tokens=1024, page_size=8)
    prompt = torch.randint(1, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()  # 0 pads
    torch.manual_seed(0)
    out = gen.hf_generate(prompt, max_new_tokens=40, pad_token_id=0, **kw)
    follow = out[0].tolist() + [5, 6, 7]
    got = gen.generate(follow, max_new_tokens=1)
    want = _forward(net, torch.tensor([follow]), _new_cache(net)).logits[0, -1]
    assert got.device_tokens == 40  # the prompt's five pages
    assert torch.allclose(got.first_logits, want, atol=1e-5, rtol=0), (got.first_logits - want).abs().max()
    gen.cache.close()


def test_the_salt_a_generator_is_built_with_is_the_tenant_of_its_calls(tmp_path):
    """``build(salt=...)`` names the tenant of every call that names none: two tenants'
    generators over one store do not read each other's KV, and a call's own salt still
    wins (before, the built salt was dropped and every tenant shared one key space)."""
    net = build("llama", layers=2, hidden=64, vocab=256, seed=1)
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(7)).tolist()

    def generator(salt=None):
        return CachedGenerator.build(net, device_tokens=256, host_tokens=256, page_size=8, salt=salt,
                                     storage=kvtier.storage.open(f"file://{tmp_path}"))

    a = generator("tenant-A")
    assert a.generate(prompt, max_new_tokens=2).storage_tokens == 0
    a.cache.flush()
    b = generator("tenant-B")
    assert b.generate(prompt, max_new_tokens=2).storage_tokens == 0  # not tenant A's
    assert generator().generate(prompt, max_new_tokens=2, salt="tenant-A").storage_tokens == 64
    assert generator("tenant-B").generate(prompt, max_new_tokens=2, salt="tenant-A").storage_tokens == 64
    for gen in (a, b):
        gen.cache.close()
