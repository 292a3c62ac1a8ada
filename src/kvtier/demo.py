"""``kvtier demo``: multi-turn chat sessions on a real Hugging Face model class, with KV reuse
from device, host and storage, checked token for token against running without kvtier.

Several sessions share a system prompt and take turns, interleaved; each turn's
prompt is the whole conversation so far plus a new user message. Device and host
capacities are smaller than the working set, so reused pages come from every tier:
the device pool, the host pool after a load, and storage after a prefetch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ._checks import positive_ints
from .hybrid import HybridSpec
from .integrations.transformers import CachedGenerator, generate_uncached


@dataclass
class Turn:
    session: int
    turn: int
    prompt: int
    device: int
    host: int
    storage: int
    prefilled: int
    prefill_ms: float
    baseline_ms: float
    identical: bool


def run(net, store, *, namespace: str, sessions: int = 4, turns: int = 5, layout: str = "page_first",
        device_tokens: int = 448, host_tokens: int = 768, page_size: int = 16, system_tokens: int = 96,
        user_tokens: int = 48, new_tokens: int = 8, seed: int = 0, retention_interval: int | None = None,
        progress=None) -> tuple[list[Turn], dict]:
    """``sessions`` x ``turns`` requests of ``net`` (e.g. ``kvtier.tiny_models.build``) through a
    cache over ``store`` (the caller's to close), each checked against running without kvtier. For a
    sliding-window model the cache keeps a window every ``retention_interval`` tokens (default: the
    system prompt's whole pages, so every session resumes after it) besides each sequence's end."""
    positive_ints(("sessions", sessions), ("turns", turns))
    rng = random.Random(seed)
    vocab = net.config.vocab_size
    if retention_interval is None:
        retention_interval = max(page_size, system_tokens // page_size * page_size)
    gen = CachedGenerator.build(net, device_tokens=device_tokens, host_tokens=host_tokens, page_size=page_size,
                                storage=store, layout=layout, namespace=namespace,
                                retention_interval=retention_interval)
    try:
        system = [rng.randrange(vocab) for _ in range(system_tokens)]
        history = [list(system) for _ in range(sessions)]
        rows = []
        for turn in range(turns):
            for s in range(sessions):
                prompt = history[s] + [rng.randrange(vocab) for _ in range(user_tokens)]
                got = gen.generate(prompt, max_new_tokens=new_tokens)
                gen.cache.flush()  # storage writes land before the next request looks for them
                ref, baseline_s = generate_uncached(net, prompt, max_new_tokens=new_tokens)
                rows.append(Turn(s, turn, len(prompt), got.device_tokens, got.host_tokens, got.storage_tokens,
                                 got.prefill_tokens, got.prefill_s * 1e3, baseline_s * 1e3, got.output == ref))
                history[s] = prompt + got.output
                if progress is not None:
                    progress()
        gen.cache.flush()
        stats = gen.cache.stats()
        return rows, {**_summary(rows, stats), "held_bytes": held_bytes(gen.spec, stats, page_size)}
    finally:
        gen.cache.close()


def held_bytes(spec, stats: dict, page_size: int) -> dict:
    """Bytes the device and host tiers hold at the end, against a window-blind cache
    holding the same tokens (every group's KV for every token)."""
    out = {}
    for tier in ("device", "host"):
        tokens = stats[f"{tier}_tokens"]
        if not isinstance(spec, HybridSpec):
            out[tier] = {"bytes": tokens * spec.bytes_per_token, "window_blind_bytes": tokens * spec.bytes_per_token}
            continue
        sliding = sum(stats["sliding_pages"][g.name][tier] * page_size * g.bytes_per_token
                      for g in spec.groups if not g.attention.is_full)
        out[tier] = {"bytes": tokens * spec.full_bytes_per_token + sliding,
                     "window_blind_bytes": tokens * spec.uniform_bytes_per_token}
    return out


def _summary(rows: list[Turn], stats: dict) -> dict:
    prompt = sum(r.prompt for r in rows)
    return {
        "requests": len(rows),
        "prompt_tokens": prompt,
        "reused": {tier: sum(getattr(r, tier) for r in rows) for tier in ("device", "host", "storage")},
        "prefilled_tokens": sum(r.prefilled for r in rows),
        "prefill_ms": sum(r.prefill_ms for r in rows),
        "baseline_prefill_ms": sum(r.baseline_ms for r in rows),
        "identical": sum(r.identical for r in rows),
        "evicted_tokens": {"device": stats["device_evicted_tokens"], "host": stats["host_evicted_tokens"]},
        "stored_tokens": stats["stored_tokens"],
    }
