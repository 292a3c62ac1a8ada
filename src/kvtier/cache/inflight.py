"""Marks for transfers in flight, shared by every node they cover.

A mark lists its nodes; a split adds the new upper node to the list, so the job
that owns the mark settles every piece of the run it started with.
"""

from __future__ import annotations

import threading

import torch

from ..errors import IntegrityError
from .residency import mark_of, set_mark

KINDS = ("load", "backup", "store")


class InFlight:
    """One transfer: ``kind`` is ``load`` (host -> device), ``backup`` (device ->
    host) or ``store`` (host -> storage). ``cancelled`` tells a job that has not
    run yet that its nodes no longer want it; ``done`` is set when it settled."""

    __slots__ = ("kind", "nodes", "cancelled", "started", "done", "device", "host", "handle", "ready", "pin", "side",
                 "queued")

    def __init__(self, kind: str, nodes: list, device: torch.Tensor | None = None,
                 host: torch.Tensor | None = None) -> None:
        if kind not in KINDS:
            raise IntegrityError(f"a transfer of kind {kind!r}; the kinds are {', '.join(KINDS)}")
        self.kind = kind
        self.nodes = nodes
        self.cancelled = False
        self.started = False
        self.done = threading.Event()
        self.device, self.host = device, host   # the slots the copy reads or fills
        self.handle = None                      # a load's LoadHandle
        self.ready = None                       # CUDA: event the copy's stream waits on
        self.pin = None                         # a load's locked node (its path stays put)
        self.side = None                        # hybrid: ({group: device slots}, {group: host slots}) of sliding pages
        self.queued = 0                         # a store's tokens in the writer's backlog while it waits

    def holders(self) -> list:
        """The nodes still carrying this mark."""
        return [n for n in self.nodes if mark_of(n, self.kind) is self]

    def clear(self) -> list:
        """Take the mark off every node that carries it; returns those nodes."""
        held = self.holders()
        for node in held:
            set_mark(node, self.kind, None)
        return held
