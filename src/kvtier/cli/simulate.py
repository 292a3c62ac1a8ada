"""``kvtier simulate``: hit ratios per tier for given capacities, swept if asked, with bounds."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from typing import NamedTuple

from ..errors import UsageError
from ..hybrid import HybridSpec
from ..sim.parallel import Oracle, Replay, cpu_count, run_task, run_tasks
from ..sim.simulator import CostModel, SimConfig
from ..sim.traces import read_mooncake, repeat, synthetic
from ..spec import KVSpec
from .preflight import check_host_memory, check_input_file, check_output_path, check_trace_copies, \
    require_module
from .spec import add_spec_arguments, bytes_fields, bytes_line, has_spec, spec_from_args
from .table import json_text, print_table
from .types import capacity, capacity_type, parse_bytes, positive_float, positive_int, seed

SWEEPABLE = ("device-tokens", "host-tokens", "storage-tokens")
TIERS = ("device", "host", "storage")
#: Token capacities when neither ``--TIER-tokens`` nor ``--TIER-bytes`` is given.
DEFAULT_TOKENS = {"device": 1_000_000, "host": 4_000_000, "storage": 0}
# NOTE: the meta-device pools hold no KV, but their free lists and ownership flags are real:
# an int64 page id plus flags per block (about 9 bytes measured), with room for transient copies.
_BYTES_PER_BLOCK = 16
_SYNTHETIC_BYTES_PER_SESSION = 8 << 10  # six requests of ~20 block ids each, as Python objects


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="Mooncake-format jsonl (timestamp, input_length, output_length, hash_ids), "
                                 "or 'synthetic' for a generated multi-turn chat workload")
    p.add_argument("--block-tokens", type=positive_int, default=512,
                   help="tokens per hash_ids block (default 512); each trace line must carry "
                        "ceil(input_length / block_tokens) hash_ids")
    p.add_argument("--device-tokens", type=capacity_type(), help="N (default 1e6)")
    p.add_argument("--host-tokens", type=capacity_type(), help="N (default 4e6)")
    p.add_argument("--storage-tokens", type=capacity_type(unlimited=True),
                   help="N, or inf; 0 for no storage (default)")
    p.add_argument("--device-bytes", metavar="SIZE",
                   help="the device tier in bytes instead of tokens: N, or with a unit KiB, MiB, GiB, TiB "
                        "(1024-based) or KB, MB, GB, TB (1000-based), e.g. 80GiB; it holds the whole tokens of "
                        "--spec that fit (rounded down)")
    p.add_argument("--host-bytes", metavar="SIZE", help="the host tier in bytes, as --device-bytes")
    p.add_argument("--storage-bytes", metavar="SIZE", help="the storage tier in bytes, as --device-bytes, or inf")
    p.add_argument("--sliding-ratio", type=positive_float, default=0.25, metavar="R",
                   help="hybrid specs: each tier's sliding-window pools hold R tokens per token of the full groups "
                        "(default 0.25); the bytes of --TIER-bytes are split so")
    p.add_argument("--window-blind", action="store_true",
                   help="hybrid specs: replay a cache that stores every group for every token (the uniform spelling "
                        "of the model), for comparison at equal bytes")
    p.add_argument("--retention-interval", type=positive_int, default=None, metavar="TOKENS",
                   help="hybrid specs: keep a window every TOKENS tokens of each sequence (rounded down to whole "
                        "blocks), so that shared prefixes stay resumable (default: sequence ends and branch points)")
    p.add_argument("--policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"])
    p.add_argument("--sweep", default=None, help="e.g. host-tokens=1e6,4e6,16e6")
    p.add_argument("--oracle", action="store_true", help="add Belady (clairvoyant) hits at the same capacities")
    p.add_argument("--jobs", type=_jobs, default=1,
                   help="worker processes for the sweep's replays and Belady computations (default 1: this process; "
                        "0: one per CPU); the output is the same for every value")
    p.add_argument("--repeat-trace", type=positive_int, default=1, metavar="N",
                   help="replay N copies of the trace one after another, block ids remapped so that copies share "
                        "no KV (default 1; 3 turns the public 3,993-request trace into kvtier bench replay's 12k)")
    p.add_argument("--prefill-tokens-per-s", type=positive_float, default=CostModel.prefill_tokens_per_s)
    p.add_argument("--host-gbps", type=positive_float, default=CostModel.host_gbps)
    p.add_argument("--storage-gbps", type=positive_float, default=CostModel.storage_gbps)
    p.add_argument("--synthetic-sessions", type=positive_int, default=200)
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    p.add_argument("--json", action="store_true",
                   help="print a JSON list, one object per configuration; an unlimited capacity (inf) is null")
    add_spec_arguments(p)


def command(args: argparse.Namespace) -> int:
    configs = _configs(args)
    check_output_path(args.plot, "--plot")
    if args.plot:
        require_module("matplotlib", "--plot", "demo")
    tasks, oracles = _tasks(configs, args.oracle)
    jobs = min(args.jobs or cpu_count(), len(tasks))
    needs = []
    for config in configs:
        blocks = (config.device_tokens + config.host_tokens) // config.block_tokens
        needs.append(int(blocks) * _BYTES_PER_BLOCK)
        check_host_memory(needs[-1], f"device {_fmt(config.device_tokens)} + host "
                          f"{_fmt(config.host_tokens)} tokens in {config.block_tokens}-token blocks",
                          "lower the capacities or raise --block-tokens")
    if jobs > 1:  # NOTE: up to ``jobs`` configurations replay at once: the largest ones must fit together
        together = sorted(needs, reverse=True)[:jobs]
        check_host_memory(sum(together), f"{len(together)} configurations replayed at once (--jobs {args.jobs})",
                          "use fewer --jobs, lower the capacities or raise --block-tokens")
    requests = _requests(args)
    if args.repeat_trace > 1:
        check_trace_copies(len(requests), sum(len(r.blocks) for r in requests), args.repeat_trace, "--repeat-trace")
        requests = repeat(requests, args.repeat_trace)
    if jobs <= 1:
        done = [_run_with_progress(requests, task, args.json) for task in tasks]
    else:
        done = _run_parallel(requests, tasks, jobs, args.json)
    results = []
    for c, result in zip(configs, done):
        for name, capacity_tokens in _oracle_capacities(c).items() if args.oracle else ():
            result.oracle[name] = done[oracles[capacity_tokens]]
        results.append((c, result))
    if args.json:
        print(json_text([{"device_tokens": _count(c.device_tokens), "host_tokens": _count(c.host_tokens),
                          "storage_tokens": _count(c.storage_tokens), **bytes_fields(c.spec), **r.as_dict()}
                         for c, r in results]))
    else:
        _print(requests, results, args.sweep)
    if args.plot:
        _plot(results, args.sweep or "host-tokens", args.plot)
    return 0


def _jobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer (0: one per CPU), got {text!r}")
    return value


class SimCapacities(NamedTuple):
    """What a replay holds: the geometry it prices copies by and each tier's capacity in
    tokens (a hybrid spec's: of its full groups, the windows beside them)."""

    spec: KVSpec | HybridSpec
    device_tokens: float
    host_tokens: float
    storage_tokens: float  # 0: no storage; inf: unlimited


def sim_capacities(spec: KVSpec | HybridSpec | None, args: argparse.Namespace) -> SimCapacities:
    """Each tier's tokens from ``--TIER-tokens`` or ``--TIER-bytes`` (whole tokens of
    ``spec.bytes_per_token``, rounded down), for ``spec`` or, when ``None``,
    :class:`SimConfig`'s default. ``UsageError`` for both options on one tier, a bad size,
    and a hybrid spec.

    A hybrid spec's bytes pay, per token of its full groups, the full groups' bytes
    plus ``--sliding-ratio`` tokens of each sliding group (its pools hold the windows);
    with ``--window-blind`` every group's bytes for every token."""
    if spec is None:
        spec = SimConfig(0, 0).spec
    if isinstance(spec, HybridSpec) and spec.is_uniform:
        spec = spec.uniform_spec
    tokens = {}
    for tier in TIERS:
        given_tokens, given_bytes = getattr(args, f"{tier}_tokens"), getattr(args, f"{tier}_bytes")
        if given_tokens is not None and given_bytes is not None:
            raise UsageError(f"--{tier}-tokens and --{tier}-bytes both size the {tier} tier; give one")
        if given_bytes is None:
            tokens[tier] = DEFAULT_TOKENS[tier] if given_tokens is None else given_tokens
            continue
        size = parse_bytes(given_bytes, f"--{tier}-bytes", unlimited=tier == "storage")
        tokens[tier] = size if math.isinf(size) else int(size // token_bytes(spec, args))
    return SimCapacities(spec, tokens["device"], tokens["host"], tokens["storage"])


def token_bytes(spec: KVSpec | HybridSpec, args: argparse.Namespace) -> float:
    """What one token of a tier's capacity costs in bytes (see :func:`sim_capacities`)."""
    if isinstance(spec, KVSpec):
        return spec.bytes_per_token
    if getattr(args, "window_blind", False):
        return spec.uniform_bytes_per_token
    ratio = getattr(args, "sliding_ratio", 0.25)
    return spec.full_bytes_per_token + ratio * sum(g.bytes_per_token for g in spec.groups if not g.attention.is_full)


def _capacity_text(args: argparse.Namespace, tier: str, tokens: float, spec: KVSpec) -> str:
    """How the user gave a tier's capacity, for an error: ``--host-tokens 100`` or
    ``--host-bytes 1MiB (8 tokens of 131,072 B)``."""
    given = getattr(args, f"{tier}_bytes")
    if given is None:
        return f"--{tier}-tokens {_fmt(tokens)}"
    return f"--{tier}-bytes {given} ({_fmt(tokens)} tokens of {token_bytes(spec, args):,.0f} B)"


def _configs(args: argparse.Namespace) -> list[SimConfig]:
    """Every configuration to replay, checked: ``UsageError`` before anything is read or built."""
    caps = sim_capacities(spec_from_args(args) if has_spec(args) else None, args)
    base = SimConfig(device_tokens=caps.device_tokens, host_tokens=caps.host_tokens,
                     storage_tokens=caps.storage_tokens, block_tokens=args.block_tokens, write_policy=args.policy,
                     cost=CostModel(args.prefill_tokens_per_s, args.host_gbps, args.storage_gbps), spec=caps.spec,
                     sliding_ratio=args.sliding_ratio, window_blind=args.window_blind,
                     retention_interval=args.retention_interval)
    configs = [base]
    if args.sweep:
        name, sep, values = args.sweep.partition("=")
        if not sep or name not in SWEEPABLE:
            raise UsageError(f"--sweep {args.sweep!r}: expected NAME=A,B,... with NAME one of {', '.join(SWEEPABLE)}")
        tier = name.partition("-")[0]
        if getattr(args, f"{tier}_bytes") is not None:
            raise UsageError(f"--sweep {name} and --{tier}-bytes both size the {tier} tier; give one")
        field = name.replace("-", "_")
        configs = []
        for text in values.split(","):
            try:
                value = capacity(text, unlimited=field == "storage_tokens")
            except ValueError as e:
                raise UsageError(f"--sweep {name}={text}: {e}") from None
            configs.append(replace(base, **{field: value}))
    for c in configs:
        for tier, tokens in (("device", c.device_tokens), ("host", c.host_tokens)):
            if tokens < c.block_tokens:
                raise UsageError(f"{_capacity_text(args, tier, tokens, c.spec)} is less than one {c.block_tokens}-token"
                                 " block; the device and host tiers need at least one block each")
        if args.storage_bytes is not None and 0 < c.storage_tokens < c.block_tokens:
            raise UsageError(f"{_capacity_text(args, 'storage', c.storage_tokens, c.spec)} is less than one "
                             f"{c.block_tokens}-token block; give 0 for no storage")
    return configs


def _requests(args: argparse.Namespace) -> list:
    if args.trace == "synthetic":
        check_host_memory(args.synthetic_sessions * _SYNTHETIC_BYTES_PER_SESSION,
                          f"--synthetic-sessions {args.synthetic_sessions}", "generate fewer sessions")
        return synthetic(sessions=args.synthetic_sessions, block_tokens=args.block_tokens, seed=args.seed)
    check_input_file(args.trace, "trace")
    try:
        requests = read_mooncake(args.trace, block_tokens=args.block_tokens)
    except OSError as e:
        raise UsageError(f"trace {args.trace}: {e.strerror or e}") from None
    if not requests:
        raise UsageError(f"trace {args.trace}: no requests (an empty file?)")
    return requests


def _tasks(configs: list[SimConfig], oracle: bool) -> tuple[list, dict[float, int]]:
    """One replay per configuration, then (with ``oracle``) one Belady computation per
    distinct capacity (an unlimited storage gives every point the same "all tiers"
    bound); returns the tasks and each capacity's index among them."""
    tasks, oracles = [Replay(c) for c in configs], {}
    if oracle:
        for c in configs:
            for capacity_tokens in _oracle_capacities(c).values():
                oracles.setdefault(capacity_tokens, len(tasks) + len(oracles))
        tasks += [Oracle(t, configs[0].block_tokens) for t in oracles]
    return tasks, oracles


def _oracle_capacities(config: SimConfig) -> dict[str, float]:
    """Belady's capacities for ``config``: device+host, and all tiers where storage exists."""
    out = {"device+host": config.device_tokens + config.host_tokens}
    if config.storage_tokens:
        out["all tiers"] = config.device_tokens + config.host_tokens + config.storage_tokens
    return out


def _run_parallel(requests, tasks, jobs: int, quiet: bool) -> list:
    """``tasks`` in ``jobs`` worker processes, with a bar of finished tasks."""
    progress = _progress(quiet)
    if progress is None:
        return run_tasks(requests, tasks, jobs)
    with progress as bar:
        task = bar.add_task(f"replaying ({jobs} jobs)", total=len(tasks))
        return run_tasks(requests, tasks, jobs, done=lambda: bar.advance(task))


def _run_with_progress(requests, task, quiet: bool):
    """One task in this process; a replay shows a bar of its requests."""
    progress = _progress(quiet) if isinstance(task, Replay) else None
    if progress is None:
        return run_task(requests, task)
    with progress as bar:
        handle = bar.add_task("replaying", total=len(requests))
        return run_task(requests, task, progress=lambda: bar.advance(handle))


def _progress(quiet: bool):
    if quiet:
        return None
    try:
        from rich.progress import Progress
    except ImportError:  # pragma: no cover
        return None
    return Progress(transient=True)


def _count(tokens: float) -> int | None:
    """A capacity for JSON: an integer, or ``None`` when unlimited."""
    return None if math.isinf(tokens) else int(tokens)


def _fmt(tokens: float) -> str:
    return "inf" if math.isinf(tokens) else f"{tokens:,.0f}"


def _pct(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def _print(requests, results, sweep) -> None:
    columns = ["device", "host", "storage", "device hit", "host hit", "storage hit", "all hits",
               "infinite bound", "of bound", "prefill saved"]
    if any(r.oracle for _, r in results):
        columns.append("Belady (d+h / all)")
    rows = []
    for c, r in results:
        row = [_fmt(c.device_tokens), _fmt(c.host_tokens), _fmt(c.storage_tokens),
               _pct(r.device_hit, r.prompt_tokens), _pct(r.host_hit, r.prompt_tokens),
               _pct(r.storage_hit, r.prompt_tokens), _pct(r.hit, r.prompt_tokens), _pct(r.bound, r.prompt_tokens),
               _pct(r.hit, r.bound), f"{r.prefill_s_without - r.prefill_s_with:,.0f} s "
               f"({_pct(r.prefill_s_without - r.prefill_s_with, r.prefill_s_without)})"]
        if r.oracle:
            row.append(" / ".join(_pct(v, r.prompt_tokens) for v in r.oracle.values()))
        rows.append(row)
    r0 = results[0][1]
    print(f"{r0.requests:,} requests, {r0.prompt_tokens:,} prompt tokens; hits as a share of prompt tokens; "
          f"prefill saved by the cost model (--prefill-tokens-per-s, --host-gbps, --storage-gbps)")
    print(bytes_line(results[0][0].spec))
    c0 = results[0][0]
    if c0.hybrid:
        print(_group_split(c0))
    elif isinstance(c0.spec, HybridSpec) and c0.window_blind:
        print(f"window-blind: every group stored for every token, {c0.spec.uniform_bytes_per_token:,} B a token")
    print_table("kvtier simulate", columns, rows)


def _group_split(config: SimConfig) -> str:
    """How a hybrid replay's tiers are split per group (tokens, bytes)."""
    parts = []
    for tier in TIERS:
        tokens = getattr(config, f"{tier}_tokens")
        if not tokens or math.isinf(tokens):
            continue
        groups = []
        for g in config.spec.groups:
            n = tokens if g.attention.is_full else int(tokens * config.sliding_ratio)
            groups.append(f"{g.name} {_fmt(n)} tokens ({n * g.bytes_per_token / 2**30:,.2f} GiB)")
        parts.append(f"{tier}: " + ", ".join(groups))
    retention = f", a window every {config.retention_interval:,} tokens" if config.retention_interval else ""
    return f"hybrid cache (sliding pools at --sliding-ratio {config.sliding_ratio:g}{retention}): " + "; ".join(parts)


def _plot(results, sweep: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = sweep.partition("=")[0]
    xs = [getattr(c, name.replace("-", "_")) for c, _ in results]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for tier in ("device_hit", "host_hit", "storage_hit"):
        ax.plot(xs, [_share(getattr(r, tier), r) for _, r in results], marker="o", label=tier.replace("_", " "))
    ax.plot(xs, [_share(r.hit, r) for _, r in results], marker="o", linewidth=2, label="all tiers")
    ax.plot(xs, [_share(r.bound, r) for _, r in results], linestyle="--", color="gray", label="infinite bound")
    if any(r.oracle for _, r in results):
        ax.plot(xs, [_share(r.oracle.get("device+host", 0), r) for _, r in results], linestyle=":",
                marker="x", label="Belady, device+host")
    finite = [x for x in xs if 0 < x < math.inf]
    if finite and max(finite) / min(finite) >= 10:
        ax.set_xscale("log")
    ax.set_xlabel(f"{name} (tokens)")
    ax.set_ylabel("share of prompt tokens hit")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("kvtier simulate: prefix hits per tier")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _share(tokens: int, result) -> float:
    return tokens / result.prompt_tokens if result.prompt_tokens else 0.0
