import pytest
import torch

from kvtier import LAYOUTS, UnsupportedLayoutError
from kvtier.layout import get_layout, require_split_heads
from tests.support.pools import LAYOUT_ORDERS


def test_layout_table_matches_contract():
    assert {n: lay.order for n, lay in LAYOUTS.items()} == LAYOUT_ORDERS


@pytest.mark.parametrize("name", list(LAYOUT_ORDERS))
def test_canonical_view_indexes_by_page_slot_layer_head_dim(name):
    lay = get_layout(name)
    sizes = {"page": 3, "slot": 4, "layer": 2, "head": 5, "dim": 6}
    buf = torch.arange(torch.Size(lay.shape(sizes)).numel()).view(lay.shape(sizes))
    canon = lay.canonical(buf)
    assert tuple(canon.shape) == (3, 4, 2, 5, 6)
    idx = {"page": 2, "slot": 1, "layer": 1, "head": 3, "dim": 4}
    assert canon[2, 1, 1, 3, 4] == buf[tuple(idx[a] for a in LAYOUT_ORDERS[name])]


def test_page_formats_and_split_heads():
    assert LAYOUTS["page_first_direct"].page_format == "comp-layer-slot-head-dim"
    assert LAYOUTS["layer_first"].page_format == "layer-comp-slot-head-dim"
    assert len({lay.page_format for lay in LAYOUTS.values()}) == 4
    assert [n for n, lay in LAYOUTS.items() if lay.supports_split_heads] == ["page_head"]


def test_unknown_layout_lists_supported():
    with pytest.raises(ValueError, match="page_first_direct"):
        get_layout("page_major")


def test_unsupported_split_heads_is_not_implemented_and_names_page_head():
    with pytest.raises(NotImplementedError, match="page_head"):
        require_split_heads(LAYOUTS["page_first"])
    with pytest.raises(UnsupportedLayoutError):
        require_split_heads(LAYOUTS["layer_first"])
