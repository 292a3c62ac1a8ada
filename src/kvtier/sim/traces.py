"""Request traces for the simulator: Mooncake's jsonl release, and a seeded synthetic chat workload.

A request is its arrival time, its output length and its prompt as a list of block
ids: equal ids at equal positions mean the same KV (Mooncake's ``hash_ids`` are
remapped hashes of 512-token prefix blocks). ``input_length`` may end inside the
last block; only whole blocks can be reused.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .._checks import is_int, is_number, non_negative_int, positive_int
from ..errors import TraceError

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1  # the cache's token ids: array('q')


@dataclass(frozen=True)
class Request:
    timestamp: float        # ms since the trace start
    input_length: int       # prompt tokens
    output_length: int      # generated tokens
    blocks: tuple[int, ...]  # block ids of the prompt, in order


def read_mooncake(path: str | Path, block_tokens: int | None = None) -> list[Request]:
    """Every request of a Mooncake-format jsonl file (``timestamp``, ``input_length``,
    ``output_length``, ``hash_ids``); :class:`TraceError` with the line number otherwise.
    With ``block_tokens``, each line must carry ceil(input_length / block_tokens) hash ids."""
    return list(iter_mooncake(path, block_tokens))


def iter_mooncake(path: str | Path, block_tokens: int | None = None) -> Iterator[Request]:
    if block_tokens is not None:
        positive_int("block_tokens", block_tokens)
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path}, line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TraceError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
            if not line.strip():
                continue
            yield _parse(line, where, block_tokens)


def _parse(line: str, where: str, block_tokens: int | None) -> Request:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e.msg})") from None
    except (ValueError, RecursionError) as e:  # an integer past int()'s digits, arrays nested past the stack
        raise TraceError(f"{where}: not a trace row ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: expected an object, got {type(row).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in row]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not all(map(is_int, ids)):
        raise TraceError(f"{where}: hash_ids must be a list of ints")
    if ids and not (_INT64_MIN <= min(ids) and max(ids) <= _INT64_MAX):
        raise TraceError(f"{where}: hash_ids must be in the int64 range, got {min(ids)}..{max(ids)}")
    for key in ("input_length", "output_length"):
        non_negative_int(f"{where}: {key}", row[key], error=TraceError)
    stamp = row["timestamp"]
    if not is_number(stamp) or not math.isfinite(stamp):
        raise TraceError(f"{where}: timestamp must be a finite number, got {stamp!r}")
    if block_tokens is not None:
        need = -(-row["input_length"] // block_tokens)
        if len(ids) != need:
            raise TraceError(f"{where}: {len(ids)} hash_ids for input_length {row['input_length']}; "
                             f"{block_tokens}-token blocks need ceil({row['input_length']} / {block_tokens}) = "
                             f"{need} (a trace cut with another block size?)")
    return Request(float(stamp), row["input_length"], row["output_length"], tuple(ids))


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


def repeat(requests: list[Request], times: int) -> list[Request]:
    """``times`` copies of ``requests``, one after another, sharing no KV: copy ``k``
    has every block id shifted by ``k * (max id - min id + 1)`` and every timestamp by
    ``k * (last - first timestamp + 1 ms)``. Copy 0 is ``requests`` unchanged.

    Tripling Mooncake's public synthetic trace this way stands in for a 12k-request
    trace (``kvtier bench replay``): the working set and the hit structure per copy
    stay those of the real trace, and the replay is three times as long."""
    positive_int("times", times)
    ids = [b for r in requests for b in r.blocks]
    id_span = max(ids) - min(ids) + 1 if ids else 0
    if ids and max(ids) + (times - 1) * id_span > _INT64_MAX:
        raise TraceError(f"{times} copies of the trace shift its hash ids ({min(ids)}..{max(ids)}) past the int64 "
                         "range; repeat it fewer times")
    stamps = [r.timestamp for r in requests]
    time_span = max(stamps) - min(stamps) + 1.0 if stamps else 0.0
    out = list(requests)
    for k in range(1, times):
        shift = k * id_span
        out.extend(Request(r.timestamp + k * time_span, r.input_length, r.output_length,
                           tuple(b + shift for b in r.blocks)) for r in requests)
    return out
