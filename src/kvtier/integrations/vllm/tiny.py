"""The old import path of :mod:`kvtier.testing.checkpoints` (tiny checkpoints vLLM and
sglang load), kept for code written against it."""

from ...testing.checkpoints import prompt, save_hybrid, save_llama  # noqa: F401
