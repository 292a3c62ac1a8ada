"""``kvtier bench replay``: how fast ``kvtier simulate`` replays a 12k-request trace.

The trace is a public one repeated (:func:`kvtier.sim.traces.repeat`: Mooncake's
3,993-request synthetic trace three times, ids remapped so copies share no KV),
replayed with docs/performance.md's configuration (1e6 device, 4e6 host tokens, unlimited
storage, write_through). The floor, measured in the same run, is one Python pass
over the same requests that looks every full block of every prompt up in a dict
and adds the missing ones: the least any replay of the trace must do.

With a ``spec`` (a hybrid one, such as the ``mimo-v2-flash`` preset), the same
requests are also replayed with that spec's cache, alternated with the uniform
reference spec's replays in each round, and its best time is given as a ratio to
the uniform spec's best (``x_uniform``): the import and the trace's reading, which
``kvtier simulate``'s wall time also holds, are left out of both.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from dataclasses import replace

from ..hybrid import HybridSpec
from ..sim.simulator import SimConfig, simulate
from ..sim.traces import Request, read_mooncake, repeat
from ..spec import KVSpec

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
        repeat_runs: int = 3, spec: KVSpec | HybridSpec | None = None) -> dict:
    """Read ``trace``, repeat it ``times``, replay it ``repeat_runs`` times (best and
    all seconds) and time the floor (best of as many runs); with ``spec``, also replay
    it with that spec's cache in each round (``result["spec"]``)."""
    t = time.perf_counter()
    requests = repeat(read_mooncake(trace, block_tokens=block_tokens), times)
    read_s = time.perf_counter() - t
    config = SimConfig(device_tokens=int(device_tokens), host_tokens=int(host_tokens),
                       storage_tokens=storage_tokens, block_tokens=block_tokens, write_policy=policy)
    other = replace(config, spec=spec) if spec is not None else None
    floor_s, replays, digests, result = [], [], set(), None
    other_s, other_digests, other_result = [], set(), None
    for _ in range(repeat_runs):
        # NOTE: floor and replays alternate, so that other load on the machine hits them alike
        t = time.perf_counter()
        floor_pass(requests, block_tokens)
        floor_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        result = simulate(requests, config).as_dict()
        replays.append(time.perf_counter() - t)
        digests.add(digest(result))
        if other is not None:
            t = time.perf_counter()
            other_result = simulate(requests, other).as_dict()
            other_s.append(time.perf_counter() - t)
            other_digests.add(digest(other_result))
    best, floor = min(replays), min(floor_s)
    identical = len(digests) == 1 and len(other_digests) <= 1
    extra = {}
    if other is not None:
        extra["spec"] = {"spec": spec.fingerprint(), "hybrid": other.hybrid, "replay_s": min(other_s),
                         "replay_s_all": other_s, "requests_per_s": len(requests) / min(other_s),
                         "x_uniform": min(other_s) / best,
                         "hits": {k: other_result[k] for k in ("device_hit", "host_hit", "storage_hit", "hit",
                                                               "bound")},
                         "digest": min(other_digests) if len(other_digests) == 1 else None}
    return {"config": {"trace": str(trace), "times": times, "requests": len(requests),
                       "blocks": sum(r.input_length // block_tokens for r in requests),
                       "device_tokens": config.device_tokens, "host_tokens": config.host_tokens,
                       "storage_tokens": storage_tokens, "policy": policy, "block_tokens": block_tokens,
                       "repeat": repeat_runs, "uniform_spec": config.spec.fingerprint()},
            "read_s": read_s, "replay_s": best, "replay_s_all": replays, "requests_per_s": len(requests) / best,
            "floor_s": floor, "x_floor": best / floor,
            "hits": {k: result[k] for k in ("device_hit", "host_hit", "storage_hit", "hit", "bound")},
            "digest": min(digests) if len(digests) == 1 else None, "identical": identical, **extra}
