"""``kvtier demo``: multi-turn chat sessions on a real Hugging Face model class, with KV reuse
from device, host and storage, checked token for token against running without kvtier.

Several sessions share a system prompt and take turns, interleaved; each turn's
prompt is the whole conversation so far plus a new user message. Device and host
capacities are smaller than the working set, so reused pages come from every tier:
the device pool, the host pool after a load, and storage after a prefetch.
"""

from __future__ import annotations

import random
import tempfile
from dataclasses import asdict, dataclass

from .integrations.tiny_models import build
from .integrations.transformers import CachedGenerator, generate_uncached
from .storage import open as open_storage


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


def run(*, model: str = "mimo", sessions: int = 4, turns: int = 5, storage: str | None = None,
        layout: str = "page_first", device_tokens: int = 448, host_tokens: int = 768, page_size: int = 16,
        system_tokens: int = 96, user_tokens: int = 48, new_tokens: int = 8, seed: int = 0, progress=None
        ) -> tuple[list[Turn], dict]:
    rng = random.Random(seed)
    net = build(model, seed=seed)
    vocab = net.config.vocab_size
    store = open_storage(storage or f"file://{tempfile.mkdtemp(prefix='kvtier-demo-')}")
    gen = CachedGenerator.build(net, device_tokens=device_tokens, host_tokens=host_tokens, page_size=page_size,
                                storage=store, layout=layout, namespace=f"demo-{model}-{seed}")
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
    summary = _summary(rows, gen.cache.stats())
    gen.cache.close()
    store.close()
    return rows, summary


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


def plot(rows: list[Turn], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(rows))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    bottom_acc = [0] * len(rows)
    for tier, color in (("device", "#2a9d8f"), ("host", "#e9c46a"), ("storage", "#f4a261"), ("prefilled", "#8d99ae")):
        values = [getattr(r, tier) for r in rows]
        top.bar(x, values, bottom=bottom_acc, color=color, label=tier)
        bottom_acc = [a + b for a, b in zip(bottom_acc, values)]
    top.set_ylabel("prompt tokens")
    top.legend(ncol=4, fontsize=8)
    top.set_title("kvtier demo: where each request's prompt KV came from")
    bottom.plot(x, [r.baseline_ms for r in rows], marker="o", label="prefill without kvtier")
    bottom.plot(x, [r.prefill_ms for r in rows], marker="o", label="prefill with kvtier")
    bottom.set_ylabel("ms")
    bottom.set_xlabel("request (sessions interleaved, turn by turn)")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rows_json(rows: list[Turn]) -> list[dict]:
    return [asdict(r) for r in rows]
