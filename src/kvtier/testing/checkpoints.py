"""Tiny random-weight checkpoints that vLLM and sglang load from disk (nothing is downloaded).

A Llama, Gemma 3 or gpt-oss config with random weights, saved by transformers, and a
byte-level BPE tokenizer trained offline on a synthetic corpus of words
``w0 .. w{words-1}`` (:func:`save_checkpoint` saves any other config the same way).
Gemma 3 (5 sliding : 1 full) and gpt-oss (alternating sliding and full, sinks, 4
experts) are hybrid: vLLM splits their KV into 6 and 2 groups.
vLLM's CPU attention wants head sizes in {32, 64, 80, 96, ...} and blocks that are a
multiple of 32 tokens. A wide ``initializer_range`` keeps logits far from flat, so a
wrong KV block changes the greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError


def save_llama(path: str | Path, *, layers: int = 4, hidden: int = 256, heads: int = 8, kv_heads: int = 2,
               head_dim: int = 32, words: int = 300, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Write a tiny Llama checkpoint with its tokenizer to ``path``; returns ``path``."""
    from transformers import LlamaConfig

    def config(vocab):
        return LlamaConfig(**common_config(vocab, hidden, layers), num_attention_heads=heads,
                           num_key_value_heads=kv_heads, head_dim=head_dim)
    return save_checkpoint(path, config, words=words, seed=seed, dtype=dtype)


def save_hybrid(path: str | Path, family: str, *, window: int = 64, layers: int | None = None, hidden: int = 256,
                words: int = 300, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Write a tiny hybrid checkpoint: ``family`` ``"gemma3"`` (6 layers, 5 sliding : 1
    full) or ``"gpt-oss"`` (4 layers alternating sliding and full, sinks, 4 experts),
    sliding layers attending to ``window`` tokens, 8 query heads over 2 KV heads of 64."""
    if family == "gemma3":
        from transformers import Gemma3TextConfig

        def config(vocab):
            # NOTE: untied embeddings and this range give varied greedy tokens; tied ones
            # with a large range repeat one token whatever the KV (blind to wrong KV)
            return Gemma3TextConfig(**common_config(vocab, hidden, layers or 6), num_attention_heads=8,
                                    num_key_value_heads=2, head_dim=64, sliding_window=window,
                                    sliding_window_pattern=6, query_pre_attn_scalar=64)
    elif family == "gpt-oss":
        from transformers import GptOssConfig

        def config(vocab):
            return GptOssConfig(**common_config(vocab, hidden, layers or 4), num_attention_heads=8,
                                num_key_value_heads=2, head_dim=64, sliding_window=window, num_local_experts=4,
                                num_experts_per_tok=2)
    else:
        raise UsageError(f"unknown hybrid family {family!r}; choose gemma3 or gpt-oss")
    return save_checkpoint(path, config, words=words, seed=seed, dtype=dtype)


def common_config(vocab: int, hidden: int, layers: int) -> dict:
    """The config fields every tiny checkpoint shares: sizes, a wide ``initializer_range``
    (logits far from flat), untied embeddings, token ids 1 and 2 for BOS and EOS."""
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                max_position_embeddings=4096, initializer_range=0.3, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False)


def save_checkpoint(path: str | Path, config, *, words: int = 300, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Write the tiny tokenizer over ``words`` words and a model of ``config(vocab)`` (a
    transformers config for that vocabulary size) with weights drawn from ``seed`` to
    ``path``; returns ``path``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    vocab = [f"w{i}" for i in range(words)]
    corpus = [" ".join(vocab[(i * 7) % words:(i * 7) % words + 40]) for i in range(words)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config(len(fast))).to(getattr(torch, dtype)).save_pretrained(out)
    return out


def prompt(words: int, offset: int = 0, vocab: int = 300) -> str:
    """A long synthetic prompt over the tiny tokenizer's words (``offset`` varies it)."""
    return " ".join(f"w{(i * 13 + offset) % vocab}" for i in range(words))
