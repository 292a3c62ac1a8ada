"""Request traces for the simulator: Mooncake's jsonl release, and a seeded synthetic chat workload.

A request is its arrival time, its output length and its prompt as a list of block
ids: equal ids at equal positions mean the same KV (Mooncake's ``hash_ids`` are
remapped hashes of 512-token prefix blocks). ``input_length`` may end inside the
last block; only whole blocks can be reused.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


class TraceError(ValueError):
    """A malformed trace line; the message names the file and line."""


@dataclass(frozen=True)
class Request:
    timestamp: float        # ms since the trace start
    input_length: int       # prompt tokens
    output_length: int      # generated tokens
    blocks: tuple[int, ...]  # block ids of the prompt, in order


def read_mooncake(path: str | Path) -> list[Request]:
    """Every request of a Mooncake-format jsonl file (``timestamp``, ``input_length``,
    ``output_length``, ``hash_ids``); :class:`TraceError` with the line number otherwise."""
    return list(iter_mooncake(path))


def iter_mooncake(path: str | Path) -> Iterator[Request]:
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            yield _parse(line, f"{path}, line {number}")


def _parse(line: str, where: str) -> Request:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: expected an object, got {type(row).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in row]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TraceError(f"{where}: hash_ids must be a list of ints")
    for key in ("input_length", "output_length"):
        if not isinstance(row[key], int) or isinstance(row[key], bool) or row[key] < 0:
            raise TraceError(f"{where}: {key} must be a non-negative int, got {row[key]!r}")
    if not isinstance(row["timestamp"], (int, float)) or isinstance(row["timestamp"], bool):
        raise TraceError(f"{where}: timestamp must be a number, got {row['timestamp']!r}")
    return Request(float(row["timestamp"]), row["input_length"], row["output_length"], tuple(ids))


def synthetic(*, sessions: int = 50, turns: int = 6, system_prompts: int = 4, system_blocks: int = 4,
              user_blocks: int = 2, output_blocks: int = 1, rate_per_s: float = 2.0, block_tokens: int = 512,
              seed: int = 0) -> list[Request]:
    """Multi-turn chats: each session starts from one of ``system_prompts`` shared
    prompts; every turn re-sends the conversation so far plus a new user message.
    Sessions arrive as a Poisson process at ``rate_per_s``; turns interleave."""
    rng = random.Random(seed)
    next_id = iter(range(1 << 62))
    systems = [[next(next_id) for _ in range(system_blocks)] for _ in range(system_prompts)]
    events = []
    t = 0.0
    for s in range(sessions):
        t += rng.expovariate(rate_per_s) * 1000
        history = list(systems[rng.randrange(system_prompts)])
        when = t
        for _ in range(turns):
            prompt = history + [next(next_id) for _ in range(user_blocks)]
            events.append(Request(when, len(prompt) * block_tokens, output_blocks * block_tokens, tuple(prompt)))
            history = prompt + [next(next_id) for _ in range(output_blocks)]
            when += rng.expovariate(1 / 20.0) * 1000  # think time, 20 s mean
    events.sort(key=lambda r: r.timestamp)
    return events
