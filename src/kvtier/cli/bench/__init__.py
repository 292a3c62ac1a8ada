"""``kvtier bench transfer|meta|storage|cache|overlap|replay``: each figure a ratio to a limit
measured in the same run."""

from __future__ import annotations

from . import cache, meta, overlap, replay, storage, transfer

#: name -> (help, add_arguments, command)
SUBCOMMANDS = {
    "transfer": ("device<->host page copies per layout and io backend", transfer.add_arguments, transfer.command),
    "meta": ("span metadata (page buffer and split-heads) p50/p90 vs a floor, optionally under CPU load",
             meta.add_arguments, meta.command),
    "storage": ("put/get GB/s per storage backend vs its raw client", storage.add_arguments, storage.command),
    "cache": ("match_prefix / insert speed over a large tree", cache.add_arguments, cache.command),
    "overlap": ("how much of load_back's per-layer host->device load hides behind compute", overlap.add_arguments,
                overlap.command),
    "replay": ("kvtier simulate's replay speed on a 12k-request trace; with a geometry (--spec mimo-v2-flash), "
               "that spec's replay too, as a ratio to the uniform reference's", replay.add_arguments,
               replay.command),
}
