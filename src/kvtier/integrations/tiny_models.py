"""Small models of real Hugging Face architectures, built from configs with random
weights (nothing is downloaded): the demo's and the tests' stand-ins for the real ones."""

from __future__ import annotations

import torch

MODELS = ("mimo", "llama", "deepseek")


def build(name: str, *, seed: int = 0, layers: int = 4, hidden: int = 256, vocab: int = 2048,
          device: str | torch.device = "cpu"):
    """A float32 ``*ForCausalLM`` in eval mode on ``device`` (weights drawn on the CPU, so a
    seed gives the same model everywhere):

    - ``mimo``: MiMo-V2-Flash, full-attention layers, K head dim 48 / V head dim 32 (3:2 like 192/128), GQA 8/2;
    - ``llama``: Llama GQA, 8 query heads over 2 KV heads of 32;
    - ``deepseek``: DeepSeek-V3 with MLA; transformers caches its latent (64) and rope key (16) as one head each.
    """
    from transformers import AutoModelForCausalLM

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    torch.manual_seed(seed)
    config = _config(name, layers, hidden, vocab)
    return AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval().to(device)


def _config(name: str, layers: int, hidden: int, vocab: int):
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  max_position_embeddings=8192, tie_word_embeddings=False)
    if name == "mimo":
        from transformers import MiMoV2FlashConfig

        return MiMoV2FlashConfig(**common, num_attention_heads=8, num_key_value_heads=2, head_dim=48, v_head_dim=32,
                                 moe_intermediate_size=hidden // 2, n_routed_experts=4, num_experts_per_tok=2,
                                 layer_types=["full_attention"] * layers)
    if name == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**common, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
                            q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                            moe_intermediate_size=hidden // 2, n_routed_experts=4, num_experts_per_tok=2,
                            n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1)
