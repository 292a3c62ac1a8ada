"""Tiny random-weight checkpoints that vLLM loads from disk (nothing is downloaded).

A Llama config with random weights, saved by transformers, and a byte-level BPE
tokenizer trained offline on a synthetic corpus of words ``w0 .. w{words-1}``.
vLLM's CPU attention wants head sizes in {32, 64, 80, 96, ...} and blocks that are a
multiple of 32 tokens. A wide ``initializer_range`` keeps logits far from flat, so a
wrong KV block changes the greedy tokens.
"""

from __future__ import annotations

from pathlib import Path


def save_llama(path: str | Path, *, layers: int = 4, hidden: int = 256, heads: int = 8, kv_heads: int = 2,
               head_dim: int = 32, words: int = 300, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Write a tiny Llama checkpoint with its tokenizer to ``path``; returns ``path``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
    config = LlamaConfig(vocab_size=len(fast), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=4096, initializer_range=0.3,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(out)
    return out


def prompt(words: int, offset: int = 0, vocab: int = 300) -> str:
    """A long synthetic prompt over the tiny tokenizer's words (``offset`` varies it)."""
    return " ".join(f"w{(i * 13 + offset) % vocab}" for i in range(words))
