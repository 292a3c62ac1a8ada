"""Sweep tasks and their results as JSON, for ``kvtier simulate --jobs`` workers.

Only JSON crosses between the processes: the parent writes the trace once and
then one task per line, each worker answers one result per line. Floats round-trip
exactly (``json`` writes ``repr``); infinity, which JSON lacks, is the string "inf".
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from typing import NamedTuple, Union

import torch

from ..errors import UsageError
from ..hybrid import Attention, HybridSpec, KVGroup
from ..spec import Component, KVSpec
from .simulator import CostModel, SimConfig, SimResult
from .traces import Request


class Replay(NamedTuple):
    config: SimConfig


class Oracle(NamedTuple):
    capacity_tokens: float
    block_tokens: int


Task = Union[Replay, Oracle]


def _number(x: float) -> float | str:
    return "inf" if x == float("inf") else x


def _float(x) -> float:
    return float("inf") if x == "inf" else x


def trace_line(requests: list[Request]) -> str:
    return json.dumps([[r.timestamp, r.input_length, r.output_length, list(r.blocks)] for r in requests])


def read_trace(line: str) -> list[Request]:
    return [Request(ts, n_in, n_out, tuple(blocks)) for ts, n_in, n_out, blocks in json.loads(line)]


def _kv_spec(spec: KVSpec) -> dict:
    return {"layer_num": spec.layer_num, "dtype": str(spec.dtype).removeprefix("torch."),
            "components": [[x.name, x.head_num, x.head_dim] for x in spec.components]}


def _read_kv_spec(spec: dict) -> KVSpec:
    dtype = getattr(torch, spec["dtype"])
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"not a torch dtype: {spec['dtype']!r}")
    return KVSpec(spec["layer_num"], tuple(Component(*x) for x in spec["components"]), dtype)


def _spec(spec: KVSpec | HybridSpec) -> dict:
    if isinstance(spec, KVSpec):
        return _kv_spec(spec)
    return {"groups": [[g.name, list(g.layers), _kv_spec(g.spec), g.attention.kind, g.attention.window]
                       for g in spec.groups]}


def _read_spec(spec: dict) -> KVSpec | HybridSpec:
    if "groups" not in spec:
        return _read_kv_spec(spec)
    return HybridSpec(tuple(KVGroup(name, tuple(layers), _read_kv_spec(kv), Attention(kind, window))
                            for name, layers, kv, kind, window in spec["groups"]))


def task_line(task: Task) -> str:
    if isinstance(task, Oracle):
        return json.dumps({"oracle": [_number(task.capacity_tokens), task.block_tokens]})
    c = task.config
    return json.dumps({"replay": {"device_tokens": c.device_tokens, "host_tokens": c.host_tokens,
                                  "storage_tokens": _number(c.storage_tokens), "block_tokens": c.block_tokens,
                                  "write_policy": c.write_policy, "spec": _spec(c.spec), "cost": asdict(c.cost),
                                  "sliding_ratio": c.sliding_ratio, "window_blind": c.window_blind,
                                  "retention_interval": c.retention_interval}})


def read_task(line: str) -> Task:
    data = json.loads(line)
    if "oracle" in data:
        capacity, block_tokens = data["oracle"]
        return Oracle(_float(capacity), block_tokens)
    c = data["replay"]
    return Replay(SimConfig(c["device_tokens"], c["host_tokens"], _float(c["storage_tokens"]), c["block_tokens"],
                            c["write_policy"], _read_spec(c["spec"]), CostModel(**c["cost"]),
                            c.get("sliding_ratio", 0.25), c.get("window_blind", False),
                            c.get("retention_interval")))


def result_line(result: SimResult | int) -> str:
    if isinstance(result, SimResult):
        return json.dumps({"replay": {f.name: getattr(result, f.name) for f in fields(SimResult)}})
    return json.dumps({"oracle": result})


def read_result(line: str) -> SimResult | int:
    data = json.loads(line)
    if "oracle" in data:
        return data["oracle"]
    return SimResult(**data["replay"])
