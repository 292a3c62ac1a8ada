"""``kvtier bench replay``: how fast ``kvtier simulate`` replays a 12k-request trace.

The trace is a public one repeated (:func:`kvtier.sim.traces.repeat`: Mooncake's
3,993-request synthetic trace three times, ids remapped so copies share no KV),
replayed with docs/performance.md's configuration (1e6 device, 4e6 host tokens, unlimited
storage, write_through). The floor, measured in the same run, is one Python pass
over the same requests that looks every full block of every prompt up in a dict
and adds the missing ones: the least any replay of the trace must do.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from ..sim.simulator import SimConfig, simulate
from ..sim.traces import Request, read_mooncake, repeat

#: Where the public trace lies in a checkout next to the shared folder (the path the docs use).
DEFAULT_TRACE = Path("../shared/traces/synthetic_trace.jsonl")


def floor_pass(requests: list[Request], block_tokens: int) -> int:
    """Blocks that a previous request already held: the floor's work, returned so
    that it cannot be optimised away (and it is the infinite-capacity bound)."""
    seen: dict[int, None] = {}
    hits = 0
    for r in requests:
        for b in r.blocks[:r.input_length // block_tokens]:
            if b in seen:
                hits += 1
            else:
                seen[b] = None
    return hits


def digest(result: dict) -> str:
    """16 hex digits over a replay's per-tier hit totals and cost figures: equal
    digests, equal replays."""
    return hashlib.sha256(json.dumps(result, sort_keys=True).encode()).hexdigest()[:16]


def run(trace: str | Path, *, times: int = 3, device_tokens: float = 1e6, host_tokens: float = 4e6,
        storage_tokens: float = float("inf"), policy: str = "write_through", block_tokens: int = 512,
        repeat_runs: int = 3) -> dict:
    """Read ``trace``, repeat it ``times``, replay it ``repeat_runs`` times (best and
    all seconds) and time the floor (best of as many runs)."""
    t = time.perf_counter()
    requests = repeat(read_mooncake(trace, block_tokens=block_tokens), times)
    read_s = time.perf_counter() - t
    config = SimConfig(device_tokens=int(device_tokens), host_tokens=int(host_tokens),
                       storage_tokens=storage_tokens, block_tokens=block_tokens, write_policy=policy)
    floor_s, replays, digests, result = [], [], set(), None
    for _ in range(repeat_runs):
        # NOTE: floor and replay alternate, so that other load on the machine hits both alike
        t = time.perf_counter()
        floor_pass(requests, block_tokens)
        floor_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        result = simulate(requests, config).as_dict()
        replays.append(time.perf_counter() - t)
        digests.add(digest(result))
    best, floor = min(replays), min(floor_s)
    identical = len(digests) == 1
    return {"config": {"trace": str(trace), "times": times, "requests": len(requests),
                       "blocks": sum(r.input_length // block_tokens for r in requests),
                       "device_tokens": config.device_tokens, "host_tokens": config.host_tokens,
                       "storage_tokens": storage_tokens, "policy": policy, "block_tokens": block_tokens,
                       "repeat": repeat_runs},
            "read_s": read_s, "replay_s": best, "replay_s_all": replays, "requests_per_s": len(requests) / best,
            "floor_s": floor, "x_floor": best / floor,
            "hits": {k: result[k] for k in ("device_hit", "host_hit", "storage_hit", "hit", "bound")},
            "digest": min(digests) if identical else None, "identical": identical}
