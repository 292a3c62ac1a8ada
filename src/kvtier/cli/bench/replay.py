"""``kvtier bench replay``: kvtier simulate's replay speed on a 12k-request trace."""

from __future__ import annotations

import argparse
import os

from ...errors import UsageError
from ..spec import PRESETS, add_spec_arguments, has_spec, spec_from_args
from ..table import json_text, print_table
from ..types import positive_int
from .args import JSON_HELP


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ...bench.replay import DEFAULT_TRACE

    p.add_argument("trace", nargs="?", default=None,
                   help=f"Mooncake-format jsonl (default {DEFAULT_TRACE}, where it exists)")
    p.add_argument("--times", type=positive_int, default=3,
                   help="copies of the trace replayed one after another, ids remapped (default 3: ~12k requests)")
    p.add_argument("--policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"])
    p.add_argument("--repeat", type=positive_int, default=3, help="replays timed, best kept (default 3)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    add_spec_arguments(p)


def command(args: argparse.Namespace) -> int:
    from ...bench import replay
    from ..preflight import check_input_file, check_trace_copies

    trace = args.trace
    if trace is None:
        if not replay.DEFAULT_TRACE.is_file():
            raise UsageError(f"no trace given and {replay.DEFAULT_TRACE} does not exist here; pass a Mooncake-format "
                             "jsonl trace")
        trace = str(replay.DEFAULT_TRACE)
    check_input_file(trace, "trace")
    # NOTE: sized from the file before it is read: a row takes at least 64 bytes of it, a block id 2
    size = os.path.getsize(trace)
    check_trace_copies(size // 64, size // 2, args.times, "--times")
    spec = spec_from_args(args) if has_spec(args) else None
    try:
        result = replay.run(trace, times=args.times, policy=args.policy, repeat_runs=args.repeat, spec=spec)
    except OSError as e:
        raise UsageError(f"trace {trace}: {e.strerror or e}") from None
    if args.json:
        print(json_text(result))
        return 0
    cfg = result["config"]
    print(f"{cfg['trace']} x{cfg['times']}: {cfg['requests']:,} requests, {cfg['blocks']:,} blocks of "
          f"{cfg['block_tokens']} tokens; device {cfg['device_tokens']:,.0f}, host {cfg['host_tokens']:,.0f}, storage "
          f"{cfg['storage_tokens']:,.0f} tokens, {cfg['policy']}; read in {result['read_s']:.2f} s")
    print("floor = one Python pass looking every full block of every prompt up in a dict (adding the missing ones)")
    runs = [(f"uniform ({cfg['uniform_spec']})", result, "")]
    if "spec" in result:  # a preset by its name, else the geometry's fingerprint
        label = args.spec if args.spec in PRESETS else result["spec"]["spec"]
        runs.append((label, result["spec"], f"{result['spec']['x_uniform']:.2f}x"))
    rows = [[name, f"{r['replay_s']:.2f}", f"{r['requests_per_s']:,.0f}", f"{result['floor_s']:.3f}",
             f"{r['replay_s'] / result['floor_s']:.0f}x", x_uniform, r["digest"] or "differs between runs"]
            for name, r, x_uniform in runs]
    print_table(f"replay (best of {cfg['repeat']}; x floor = replay s / floor s, x uniform = replay s / the uniform "
                "spec's, same run)", ["spec", "replay s", "requests/s", "floor s", "x floor", "x uniform", "digest"],
                rows)
    for name, r, _ in runs:
        hits = r["hits"]
        print(f"{name} hits (tokens): device {hits['device_hit']:,}, host {hits['host_hit']:,}, storage "
              f"{hits['storage_hit']:,}; infinite bound {hits['bound']:,}")
    return 0 if result["identical"] else 1
