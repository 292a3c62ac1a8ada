"""Tiny sliding-window and hybrid models of eight transformers families, built from
configs with random weights: windows of 16 past tokens (``sliding_window=17``,
which counts the query), well below the prompts the tests send."""

from __future__ import annotations

import torch

WINDOW = 16
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, max_position_embeddings=4096,
               tie_word_embeddings=False, sliding_window=WINDOW + 1)


def _configs():
    import transformers as t

    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    return {
        # the real pattern: full at 0 and 5 of 6, twice the KV heads and sinks on the sliding layers, K 24 / V 16
        "mimo": lambda: t.MiMoV2FlashConfig(**_COMMON, num_hidden_layers=6, num_attention_heads=4,
                                            num_key_value_heads=1, head_dim=24, v_head_dim=16,
                                            moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2),
        "gemma3": lambda: t.Gemma3TextConfig(**_COMMON, **heads, num_hidden_layers=6, head_dim=16,
                                             sliding_window_pattern=6),
        "gpt_oss": lambda: t.GptOssConfig(**_COMMON, **heads, num_hidden_layers=4, head_dim=16, num_local_experts=4,
                                          num_experts_per_tok=2),
        "mistral": lambda: t.MistralConfig(**_COMMON, **heads, num_hidden_layers=3, head_dim=16),  # all sliding
        "cohere2": lambda: t.Cohere2Config(**_COMMON, **heads, num_hidden_layers=4),
        "olmo3": lambda: t.Olmo3Config(**_COMMON, **heads, num_hidden_layers=4),
        "qwen3": lambda: t.Qwen3Config(**_COMMON, **heads, num_hidden_layers=4, head_dim=16, use_sliding_window=True,
                                       max_window_layers=2),
        "exaone4": lambda: t.Exaone4Config(**_COMMON, **heads, num_hidden_layers=4, sliding_window_pattern=4),
    }


FAMILIES = ("mimo", "gemma3", "gpt_oss", "mistral", "cohere2", "olmo3", "qwen3", "exaone4")


def build(name: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    config = _configs()[name]()
    if getattr(config, "eos_token_id", None) is not None and config.eos_token_id >= config.vocab_size:
        config.eos_token_id = None  # some families default to ids outside this small vocabulary
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def sliding_layers(model) -> list[int]:
    """The config's own answer to which layers slide (``layer_types``; all of them for
    a model with a window and no layer types, as Mistral)."""
    types = getattr(model.config, "layer_types", None)
    if types is None:
        return list(range(model.config.num_hidden_layers))
    return [i for i, kind in enumerate(types) if kind == "sliding_attention"]
