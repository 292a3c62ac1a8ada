"""One component's memory seen page by page in the canonical axis order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..transfer.copy import as_numpy


@dataclass(frozen=True)
class PageViews:
    """Views (no copies) of one component of a pool, in canonical axis order.

    ``all_layers``: ``(page, slot, layer, head, dim)``, or ``None`` when the layers
    are separate allocations that no single strided view spans.
    ``layers[l]``: ``(page, slot, head, dim)``.
    The ``np_*`` twins view the same memory as numpy arrays (CPU pools only).
    """

    all_layers: torch.Tensor | None
    layers: tuple[torch.Tensor, ...]
    np_all_layers: np.ndarray | None
    np_layers: tuple[np.ndarray, ...] | None
    #: where the memory lives (read once: a torch attribute per copy cost microseconds
    #: right after a large copy had evicted the interpreter's data from the caches)
    device: torch.device

    @classmethod
    def build(cls, all_layers: torch.Tensor | None, layers: tuple[torch.Tensor, ...]) -> "PageViews":
        device = layers[0].device
        on_cpu = device.type == "cpu"
        return cls(
            all_layers,
            layers,
            as_numpy(all_layers) if on_cpu and all_layers is not None else None,
            tuple(as_numpy(t) for t in layers) if on_cpu else None,
            device,
        )

    def arrays(self, use_numpy: bool):
        """``(all_layers, layers)`` as numpy arrays or torch tensors."""
        if use_numpy:
            return self.np_all_layers, self.np_layers
        return self.all_layers, self.layers
