"""``kvtier bench replay``: kvtier simulate's replay speed on a 12k-request trace."""

from __future__ import annotations

import argparse

from ...errors import UsageError
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


def command(args: argparse.Namespace) -> int:
    from ...bench import replay
    from ..preflight import check_input_file

    trace = args.trace
    if trace is None:
        if not replay.DEFAULT_TRACE.is_file():
            raise UsageError(f"no trace given and {replay.DEFAULT_TRACE} does not exist here; pass a Mooncake-format "
                             "jsonl trace")
        trace = str(replay.DEFAULT_TRACE)
    check_input_file(trace, "trace")
    try:
        result = replay.run(trace, times=args.times, policy=args.policy, repeat_runs=args.repeat)
    except OSError as e:
        raise UsageError(f"trace {trace}: {e.strerror or e}") from None
    if args.json:
        print(json_text(result))
        return 0
    cfg, hits = result["config"], result["hits"]
    print(f"{cfg['trace']} x{cfg['times']}: {cfg['requests']:,} requests, {cfg['blocks']:,} blocks of "
          f"{cfg['block_tokens']} tokens; device {cfg['device_tokens']:,.0f}, host {cfg['host_tokens']:,.0f}, storage "
          f"{cfg['storage_tokens']:,.0f} tokens, {cfg['policy']}; read in {result['read_s']:.2f} s")
    print("floor = one Python pass looking every full block of every prompt up in a dict (adding the missing ones)")
    rows = [[f"{result['replay_s']:.2f}", f"{result['requests_per_s']:,.0f}", f"{result['floor_s']:.3f}",
             f"{result['x_floor']:.0f}x", result["digest"] or "differs between runs"]]
    print_table(f"replay (best of {cfg['repeat']}; x floor = replay s / floor s, same run)",
                ["replay s", "requests/s", "floor s", "x floor", "digest"], rows)
    print(f"hits (tokens): device {hits['device_hit']:,}, host {hits['host_hit']:,}, storage {hits['storage_hit']:,}; "
          f"infinite bound {hits['bound']:,}")
    return 0 if result["identical"] else 1
