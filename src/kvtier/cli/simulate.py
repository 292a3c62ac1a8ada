"""``kvtier simulate``: hit ratios per tier for given capacities, swept if asked, with bounds."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from ..sim.simulator import CostModel, SimConfig, belady_hits, simulate
from ..sim.traces import read_mooncake, synthetic
from .spec import add_spec_arguments, spec_from_args
from .table import print_table

SWEEPABLE = ("device-tokens", "host-tokens", "storage-tokens")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="Mooncake-format jsonl (timestamp, input_length, output_length, hash_ids), "
                                 "or 'synthetic' for a generated multi-turn chat workload")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per hash_ids block (default 512)")
    p.add_argument("--device-tokens", type=_tokens, default=1_000_000)
    p.add_argument("--host-tokens", type=_tokens, default=4_000_000)
    p.add_argument("--storage-tokens", type=_tokens, default=0, help="N, or inf; 0 for no storage (default)")
    p.add_argument("--policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"])
    p.add_argument("--sweep", default=None, help="e.g. host-tokens=1e6,4e6,16e6")
    p.add_argument("--oracle", action="store_true", help="add Belady (clairvoyant) hits at the same capacities")
    p.add_argument("--prefill-tokens-per-s", type=float, default=CostModel.prefill_tokens_per_s)
    p.add_argument("--host-gbps", type=float, default=CostModel.host_gbps)
    p.add_argument("--storage-gbps", type=float, default=CostModel.storage_gbps)
    p.add_argument("--synthetic-sessions", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None)
    p.add_argument("--json", action="store_true")
    add_spec_arguments(p)


def _tokens(text: str) -> float:
    if text.strip().lower() in ("inf", "infinite", "unlimited"):
        return float("inf")
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"capacity must be >= 0, got {text}")
    return value


def run(args: argparse.Namespace) -> int:
    requests = (synthetic(sessions=args.synthetic_sessions, block_tokens=args.block_tokens, seed=args.seed)
                if args.trace == "synthetic" else read_mooncake(args.trace))
    has_spec = any(getattr(args, k, None) for k in ("spec", "mha", "mla", "k_only", "components"))
    base = SimConfig(device_tokens=args.device_tokens, host_tokens=args.host_tokens,
                     storage_tokens=args.storage_tokens, block_tokens=args.block_tokens, write_policy=args.policy,
                     cost=CostModel(args.prefill_tokens_per_s, args.host_gbps, args.storage_gbps),
                     **({"spec": spec_from_args(args)} if has_spec else {}))
    configs = [base]
    if args.sweep:
        name, _, values = args.sweep.partition("=")
        if name not in SWEEPABLE:
            raise ValueError(f"--sweep {name!r}: sweepable are {', '.join(SWEEPABLE)}")
        configs = [replace(base, **{name.replace("-", "_"): _tokens(v)}) for v in values.split(",")]
    results = []
    for config in configs:
        result = _simulate_with_progress(requests, config, quiet=args.json)
        if args.oracle:
            result.oracle["device+host"] = belady_hits(requests, config.device_tokens + config.host_tokens,
                                                       config.block_tokens)
            if config.storage_tokens:
                result.oracle["all tiers"] = belady_hits(
                    requests, config.device_tokens + config.host_tokens + config.storage_tokens, config.block_tokens)
        results.append((config, result))
    if args.json:
        print(json.dumps([{"device_tokens": c.device_tokens, "host_tokens": c.host_tokens,
                           "storage_tokens": c.storage_tokens, **r.as_dict()} for c, r in results], indent=2))
    else:
        _print(requests, results, args.sweep)
    if args.plot:
        _plot(results, args.sweep or "host-tokens", args.plot)
    return 0


def _simulate_with_progress(requests, config, quiet: bool):
    try:
        from rich.progress import Progress
    except ImportError:  # pragma: no cover
        return simulate(requests, config)
    if quiet:
        return simulate(requests, config)
    with Progress(transient=True) as bar:
        task = bar.add_task("replaying", total=len(requests))
        return simulate(requests, config, progress=lambda: bar.advance(task))


def _fmt(tokens: float) -> str:
    return "inf" if tokens == float("inf") else f"{tokens:,.0f}"


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
    print_table("kvtier simulate", columns, rows)


def _plot(results, sweep: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = sweep.partition("=")[0]
    xs = [getattr(c, name.replace("-", "_")) for c, _ in results]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for tier in ("device_hit", "host_hit", "storage_hit"):
        ax.plot(xs, [getattr(r, tier) / r.prompt_tokens for _, r in results], marker="o", label=tier.replace("_", " "))
    ax.plot(xs, [r.hit / r.prompt_tokens for _, r in results], marker="o", linewidth=2, label="all tiers")
    ax.plot(xs, [r.bound / r.prompt_tokens for _, r in results], linestyle="--", color="gray", label="infinite bound")
    if any(r.oracle for _, r in results):
        ax.plot(xs, [r.oracle.get("device+host", 0) / r.prompt_tokens for _, r in results], linestyle=":",
                marker="x", label="Belady, device+host")
    finite = [x for x in xs if 0 < x < float("inf")]
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
