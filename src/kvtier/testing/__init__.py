"""Fixtures for trying and testing kvtier with the engines; nothing in kvtier imports them.

- :mod:`kvtier.testing.checkpoints`: tiny random-weight checkpoints (Llama, Gemma 3,
  gpt-oss) with an offline tokenizer, which vLLM and sglang load from disk: the
  engines' tests, the examples in docs/vllm.md and ``scripts/vllm_ttft.py`` run on them.

They need ``transformers`` (the ``demo`` extra) and write files; the product's own
small models, which ``kvtier demo`` runs, are :mod:`kvtier.tiny_models`.
"""
