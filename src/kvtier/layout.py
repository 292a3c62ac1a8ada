"""Layouts as data: an axis order, from which shapes, views and spans follow.

Vocabulary used everywhere in kvtier: ``# (page, slot, layer, head, dim)`` is the
*canonical* axis order. A layout is one permutation of those axes; a component's
host buffer is allocated in that order (one of :data:`LAYOUTS`), a device pool's
in :data:`DEVICE_LAYOUT`. Nothing else about a layout is special-cased:
views, page spans, pointer offsets and contiguity are all derived from the order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UnsupportedLayoutError, UsageError

AXES = ("page", "slot", "layer", "head", "dim")


@dataclass(frozen=True)
class Layout:
    name: str
    order: tuple[str, ...]  # axis order of each component's host buffer

    def __post_init__(self) -> None:
        if sorted(self.order) != sorted(AXES):
            raise UsageError(f"layout {self.name}: {self.order} is not a permutation of {AXES}")

    def shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        """Buffer shape in this layout's order, from ``{axis: size}``."""
        return tuple(sizes[a] for a in self.order)

    def canonical(self, buffer: torch.Tensor) -> torch.Tensor:
        """View of a buffer in this layout as ``(page, slot, layer, head, dim)``."""
        return buffer.permute([self.order.index(a) for a in AXES])

    @property
    def outer(self) -> tuple[str, ...]:
        """Axes outside the page axis. A page is one contiguous span per index of these."""
        return self.order[: self.order.index("page")]

    @property
    def inner(self) -> tuple[str, ...]:
        """Axes inside the page axis: the native byte order of one page span."""
        return self.order[self.order.index("page") + 1:]

    @property
    def page_format(self) -> str:
        """Byte order of a page as the page buffer metadata lists it: outer axes,
        then the component, then the span's axes. Layouts that produce the same
        byte stream share a format (``page_first_direct`` equals the canonical flat page)."""
        return "-".join((*self.outer, "comp", *self.inner))

    @property
    def supports_split_heads(self) -> bool:
        """A head group of a page is one contiguous span only when the page is
        outermost and heads come right after it."""
        return self.order[:2] == ("page", "head")


LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout("layer_first", ("layer", "page", "slot", "head", "dim")),
        Layout("page_first", ("page", "slot", "layer", "head", "dim")),
        Layout("page_first_direct", ("page", "layer", "slot", "head", "dim")),
        Layout("page_head", ("page", "head", "slot", "layer", "dim")),
    )
}

#: The device (L1) pool's order: per layer, token-major ``(size, head, dim)`` buffers, as
#: engines hold them (``size`` = page x slot). Not a host layout to choose: the engine fixes it.
DEVICE_LAYOUT = Layout("device", ("layer", "page", "slot", "head", "dim"))

#: canonical flat page: per component ``(layer, slot, head, dim)``.
FLAT_PAGE_FORMAT = "comp-layer-slot-head-dim"


def get_layout(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except (KeyError, TypeError):
        raise UsageError(f"unknown layout {name!r}; supported: {', '.join(LAYOUTS)}") from None


def split_heads_layouts() -> list[str]:
    return [n for n, lay in LAYOUTS.items() if lay.supports_split_heads]


def require_split_heads(layout: Layout) -> None:
    if not layout.supports_split_heads:
        raise UnsupportedLayoutError(
            f"split-heads page metadata needs each head group of a page to be contiguous, "
            f"which layout {layout.name!r} does not give; use layout={split_heads_layouts()[0]!r}"
        )


def contiguous_run(view: torch.Tensor) -> int:
    """Elements in the innermost contiguous block of a strided view: the longest
    piece one ``memcpy`` can move when copying ``view`` element by element."""
    run = 1
    for size, stride in sorted(zip(view.shape, view.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != run:
            break
        run *= size
    return run
