from kvtier import KVSpec
from kvtier.cli.layout_report import layout_reports


def test_reports_for_asymmetric_spec():
    spec = KVSpec.mha(61, 8, 192, v_head_dim=128)
    reports = {r.layout: r for r in layout_reports(spec, 64)}
    page = 64 * spec.bytes_per_token
    assert {r.page_bytes for r in reports.values()} == {page}
    k_span, v_span = 64 * 8 * 192 * 2, 64 * 8 * 128 * 2
    lf = reports["layer_first"]
    assert (lf.spans_per_page, lf.span_bytes) == (61 * 2, (v_span, k_span))
    assert (lf.load_chunk_bytes, lf.load_chunks_per_page) == (v_span, 2)
    pf = reports["page_first"]
    assert (pf.spans_per_page, pf.span_bytes) == (2, (61 * v_span, 61 * k_span))
    assert (pf.load_chunk_bytes, pf.load_chunks_per_page) == (8 * 128 * 2, 2 * 64)  # one token's heads
    ph = reports["page_head"]
    assert (ph.load_chunk_bytes, ph.load_chunks_per_page) == (128 * 2, 2 * 64 * 8)  # one head's dims
    assert [r.layout for r in reports.values() if r.split_heads] == ["page_head"] and ph.max_split == 8
    assert reports["page_first_direct"].load_chunk_bytes == v_span


def test_max_split_is_common_divisor_of_head_counts():
    from kvtier import Component
    import torch

    spec = KVSpec(2, (Component("k", 4, 8), Component("v", 6, 8)), torch.float16)
    assert {r.layout: r.max_split for r in layout_reports(spec, 4)}["page_head"] == 2
