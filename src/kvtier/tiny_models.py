"""Small models of real Hugging Face architectures, built from configs with random
weights (nothing is downloaded): the demo's and the tests' stand-ins for the real ones."""

from __future__ import annotations

import torch

from .errors import UsageError

MODELS = ("mimo", "gemma3", "gpt-oss", "llama", "deepseek", "mimo-full")
#: Past tokens a sliding layer attends to in the hybrid models (their ``sliding_window`` is
#: one more: transformers counts the query), well below the demo's 150-400-token prompts.
WINDOW = 32
_LAYERS = {"mimo": 6, "gemma3": 6}  # the patterns' period: full at 0 and 5 (MiMo), 5 sliding : 1 full (Gemma 3)


def build(name: str, *, seed: int = 0, layers: int | None = None, hidden: int = 256, vocab: int = 2048,
          device: str | torch.device = "cpu"):
    """A float32 ``*ForCausalLM`` in eval mode on ``device`` (weights drawn on the CPU, so a
    seed gives the same model everywhere):

    - ``mimo``: MiMo-V2-Flash in its own layer pattern: full attention at layers 0 and 5 of 6, sliding
      window (32) on the others with twice the KV heads and learned sinks; K head dim 48 / V 32 (3:2 like
      192/128), GQA 8/2 on the full layers;
    - ``gemma3``: Gemma 3, 5 sliding (32) : 1 full, 8 query heads over 2 KV heads of 32;
    - ``gpt-oss``: gpt-oss, alternating sliding (32) and full layers, sinks, a mixture of 4 experts;
    - ``llama``: Llama GQA, 8 query heads over 2 KV heads of 32;
    - ``deepseek``: DeepSeek-V3 with MLA; transformers caches its latent (64) and rope key (16) as one head each;
    - ``mimo-full``: MiMo-V2-Flash with every layer full attention (one geometry, K 48 / V 32).
    """
    from transformers import AutoModelForCausalLM

    if name not in MODELS:
        raise UsageError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    torch.manual_seed(seed)
    config = _config(name, layers or _LAYERS.get(name, 4), hidden, vocab)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().to(device)


def _config(name: str, layers: int, hidden: int, vocab: int):
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  max_position_embeddings=8192, tie_word_embeddings=False)
    window = dict(sliding_window=WINDOW + 1)
    if name in ("mimo", "mimo-full"):
        from transformers import MiMoV2FlashConfig

        pattern = {"layer_types": ["full_attention"] * layers} if name == "mimo-full" else window
        return MiMoV2FlashConfig(**common, num_attention_heads=8, num_key_value_heads=2, head_dim=48, v_head_dim=32,
                                 moe_intermediate_size=hidden // 2, n_routed_experts=4, num_experts_per_tok=2,
                                 **pattern)
    if name == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(**common, **window, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                sliding_window_pattern=6)
    if name == "gpt-oss":
        from transformers import GptOssConfig

        return GptOssConfig(**common, **window, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                            num_local_experts=4, num_experts_per_tok=2)
    if name == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**common, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
                            q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                            moe_intermediate_size=hidden // 2, n_routed_experts=4, num_experts_per_tok=2,
                            n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1)
