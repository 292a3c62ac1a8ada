"""``kvtier demo``: the command around :func:`kvtier.demo.run`: storage, checks, table, plot, JSON."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import asdict

from ..errors import UsageError
from ..tiny_models import MODELS
from ..layout import LAYOUTS
from ..pools.common import check_device
from .preflight import check_device_memory, check_host_memory, check_output_path, require_module
from .table import json_text, print_table
from .types import positive_int, seed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="mimo", choices=list(MODELS))
    p.add_argument("--sessions", type=positive_int, default=4)
    p.add_argument("--turns", type=positive_int, default=5)
    p.add_argument("--storage", default=None, help="storage URL (default: file:// in a temporary directory, "
                                                   "removed at the end unless --keep-storage)")
    p.add_argument("--keep-storage", action="store_true",
                   help="keep the temporary storage directory and print where it is")
    p.add_argument("--layout", default="page_first", choices=list(LAYOUTS))
    p.add_argument("--device-tokens", type=positive_int, default=448, help="a multiple of --page-size")
    p.add_argument("--host-tokens", type=positive_int, default=768, help="a multiple of --page-size")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--device", default="cpu",
                   help="the model's, the device pool's and the computation's device: cpu (default), cuda, cuda:N")
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    p.add_argument("--json", default=None, help="write the rows and summary as JSON here (strict: a non-finite "
                                                "number is null)")


def command(args: argparse.Namespace) -> int:
    _check(args)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", category=FutureWarning)
    with _storage(args) as (store, where):
        print(f"kvtier demo: tiny {args.model} (random weights) on {args.device}, {args.sessions} sessions x "
              f"{args.turns} turns, device {args.device_tokens} / host {args.host_tokens} tokens, storage {where}; "
              "every request is run again without kvtier")
        rows, summary = _run(args, store)
    _report(rows, summary)
    if args.plot:
        plot(rows, args.plot, summary.get("held_bytes"))
        print(f"plot written to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            f.write(json_text({"rows": [asdict(r) for r in rows], "summary": summary}))
    if summary["identical"] != summary["requests"]:
        print("FAILED: kvtier changed generated tokens", file=sys.stderr)
        return 1
    return 0


def _check(args: argparse.Namespace) -> None:
    check_device(args.device)
    for flag, tokens in (("--device-tokens", args.device_tokens), ("--host-tokens", args.host_tokens)):
        if tokens % args.page_size:
            raise UsageError(f"{flag} {tokens} is not a multiple of --page-size {args.page_size}")
    check_output_path(args.plot, "--plot")
    check_output_path(args.json, "--json")
    require_module("transformers", "kvtier demo", "demo")
    if args.plot:
        require_module("matplotlib", "--plot", "demo")


def _run(args: argparse.Namespace, store):
    from .. import demo
    from ..tiny_models import build
    from ..integrations.transformers import spec_from_model
    from ..pools.hybrid import as_hybrid

    net = build(args.model, seed=args.seed, device=args.device)
    bytes_per_token = as_hybrid(spec_from_model(net)).uniform_bytes_per_token  # every group for every token: at most
    host, device = args.host_tokens * bytes_per_token, args.device_tokens * bytes_per_token
    what = f"device {args.device_tokens} + host {args.host_tokens} tokens of {bytes_per_token} bytes"
    if net.device.type == "cuda":
        check_device_memory(device, net.device, what, "use fewer device tokens")
    else:
        host += device
    check_host_memory(host, what, "use fewer tokens")
    kwargs = dict(namespace=f"demo-{args.model}-{args.seed}", sessions=args.sessions, turns=args.turns,
                  layout=args.layout, device_tokens=args.device_tokens, host_tokens=args.host_tokens,
                  page_size=args.page_size, seed=args.seed)
    try:
        from rich.progress import Progress
    except ImportError:  # pragma: no cover
        return demo.run(net, store, **kwargs)
    with Progress(transient=True) as bar:
        task = bar.add_task("requests", total=args.sessions * args.turns)
        return demo.run(net, store, **kwargs, progress=lambda: bar.advance(task))


@contextlib.contextmanager
def _storage(args: argparse.Namespace):
    """``(store, description)`` for ``--storage``, or for a temporary directory that is removed
    on the way out (also after an error or Ctrl-C) unless ``--keep-storage``."""
    if args.storage:
        store = _open(args.storage)
        try:
            yield store, args.storage
        finally:
            store.close()
        return
    temp = tempfile.mkdtemp(prefix="kvtier-demo-")
    try:
        store = _open(f"file://{temp}")
        try:
            yield store, f"file://{temp} (kept)" if args.keep_storage else "file (temporary directory)"
        finally:
            store.close()
    finally:
        if not args.keep_storage:
            shutil.rmtree(temp, ignore_errors=True)


def _open(url: str):
    """Open ``url`` and probe it with one existence check; ``UsageError`` when either fails.
    Backends report an unreachable server as a warning and a counted error, not an exception:
    the warnings are captured here and the first becomes the message."""
    from ..storage import open as open_storage

    with _captured_warnings() as records:
        try:
            store = open_storage(url)
        # NOTE: besides ValueError and OSError, backends may let their clients' own errors through
        # (redis-py's cluster discovery, Mooncake's setup) when a server cannot be reached.
        except Exception as e:
            why = str(e) if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}"
            raise UsageError(f"--storage {url}: {why}") from None
        before = store.stats()["errors"]
        store.batch_exists(["kvtier-demo-probe"])
        failed = store.stats()["errors"] > before
    if failed:
        store.close()
        why = records[0].getMessage() if records else "the probe counted an error"
        raise UsageError(f"--storage {url}: unreachable: {why}")
    return store


@contextlib.contextmanager
def _captured_warnings():
    """Log records of the ``kvtier`` loggers, kept here instead of printed."""
    logger, handler = logging.getLogger("kvtier"), _Records()
    propagate, logger.propagate = logger.propagate, False
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _report(rows, s: dict) -> None:
    print_table("per request (tokens; prefill ms with and without kvtier)",
                ["session", "turn", "prompt", "device", "host", "storage", "prefilled", "ms kvtier", "ms without",
                 "output"],
                [[r.session, r.turn, r.prompt, r.device, r.host, r.storage, r.prefilled, f"{r.prefill_ms:.1f}",
                  f"{r.baseline_ms:.1f}", "identical" if r.identical else "DIFFERENT"] for r in rows])
    reused = sum(s["reused"].values())
    print(f"prompt tokens {s['prompt_tokens']}: reused {reused} ({reused / s['prompt_tokens']:.0%}) = device "
          f"{s['reused']['device']} + host {s['reused']['host']} + storage {s['reused']['storage']}; "
          f"prefilled {s['prefilled_tokens']}")
    print(f"prefill time {s['prefill_ms']:.0f} ms with kvtier vs {s['baseline_prefill_ms']:.0f} ms without "
          f"({_less_or_more(s['prefill_ms'], s['baseline_prefill_ms'])}); outputs identical in "
          f"{s['identical']} of {s['requests']} requests")
    held = s.get("held_bytes")
    if held:
        print("KV held at the end: " + "; ".join(
            f"{tier} {v['bytes']:,} B (a window-blind cache: {v['window_blind_bytes']:,} B, "
            f"{v['window_blind_bytes'] / max(v['bytes'], 1):.1f}x)" for tier, v in held.items()))


def _less_or_more(with_ms: float, without_ms: float) -> str:
    """``"3.0x less"`` when kvtier is faster, ``"1.5x more"`` when it is slower."""
    with_ms, without_ms = max(with_ms, 1e-9), max(without_ms, 1e-9)
    return f"{without_ms / with_ms:.1f}x less" if without_ms >= with_ms else f"{with_ms / without_ms:.1f}x more"


def plot(rows, path: str, held: dict | None = None) -> None:
    """Where each request's KV came from and its prefill time; with ``held`` (the
    summary's ``held_bytes``) a panel of the bytes each tier holds at the end against a
    cache that stores every layer for every token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(rows))
    if held:
        fig = plt.figure(figsize=(12, 6))
        grid = fig.add_gridspec(2, 4)
        top, bottom = fig.add_subplot(grid[0, :3]), fig.add_subplot(grid[1, :3])
        _plot_held(fig.add_subplot(grid[:, 3]), held)
    else:
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


def _plot_held(ax, held: dict) -> None:
    tiers = list(held)
    at = range(len(tiers))
    ax.bar([i - 0.2 for i in at], [held[t]["bytes"] / 2**20 for t in tiers], width=0.4, color="#2a9d8f",
           label="kvtier")
    ax.bar([i + 0.2 for i in at], [held[t]["window_blind_bytes"] / 2**20 for t in tiers], width=0.4,
           color="#8d99ae", label="every layer, every token")
    ax.set_xticks(list(at), tiers)
    ax.set_ylabel("MiB held at the end")
    ax.set_title("KV bytes per tier", fontsize=10)
    ax.legend(fontsize=8)
