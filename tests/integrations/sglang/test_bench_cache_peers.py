"""``kvtier bench cache`` beside sglang 0.5.23's ``UnifiedRadixCache`` (its Rust tree
core) on small trees: both hit each prompt in full, in the slots each was given, and
the figures are there (no thresholds: the machine's speed is not the test's)."""

import json
import math

import pytest

pytest.importorskip("sglang.srt")

import torch  # noqa: E402

from kvtier.bench import cache_peers  # noqa: E402
from kvtier.bench.cache import Prompts  # noqa: E402
from kvtier.cli import main  # noqa: E402
from kvtier.errors import IntegrityError  # noqa: E402

PAGE = 16
PROMPT = 256  # 16 pages, of which the first 4 (a quarter) are the shared prefix


@pytest.fixture(scope="module")
def api():
    api, why = cache_peers.load_sglang()
    assert api is not None, why
    return api


def test_without_the_rust_core_the_comparison_is_skipped_with_sglangs_reason(monkeypatch):
    from sglang.srt.mem_cache.unified_cache import tree_core_registry

    monkeypatch.setattr(tree_core_registry, "_rust_fallback_reason", lambda params: "no Rust here, says the test")
    api, why = cache_peers.load_sglang()
    assert api is None
    assert why == "sglang 0.5.23 has no Rust tree core here (no Rust here, says the test); it uses UnifiedTreeCore"


def slots_of(pages) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def test_sglang_is_its_rust_core_and_hits_the_slots_it_was_given(api):
    tree = cache_peers.SglangTree(api, PAGE, 300 * PAGE)
    assert tree.core == cache_peers.RUST_CORE
    prompts = Prompts(PROMPT, seed=0)
    a, b, c = prompts.array(), prompts.array(), prompts.array()
    # NOTE: page 0 is sglang's padding page; freed pages go back to the front of its list
    assert [(s.tolist(), already) for s, already in map(tree.insert, (a, b, c))] == [
        (slots_of(range(1, 17)).tolist(), 0),
        (slots_of(range(17, 33)).tolist(), 64),
        (slots_of([17, 18, 19, 20, *range(33, 45)]).tolist(), 64)]
    # its insert freed the prefix pages b and c brought (17-20) itself, each time
    assert tree.pages() == 16 + 12 + 12
    # the prefix in a's pages, then each prompt's own
    for prompt, pages in ((a, range(1, 17)), (b, [1, 2, 3, 4, *range(21, 33)]), (c, [1, 2, 3, 4, *range(33, 45)])):
        length, slots = tree.hit(prompt)
        assert length == PROMPT and slots.tolist() == slots_of(pages).tolist()


def test_both_trees_hit_in_full_and_the_figures_are_there(api):
    rows = [cache_peers.compare(api, page, PROMPT, 300, seed=0) for page in (16, 64)]
    # 300 pages hold the first prompt and 23 more of 12 new pages (page 16), 98 more of 3 (page 64)
    assert [(r["page_size"], r["tree_pages"], r["prompts"]) for r in rows] == [(16, 292, 24), (64, 298, 99)]
    for r in rows:
        assert r["tree_core"] == cache_peers.RUST_CORE and r["prompt_tokens"] == PROMPT
        for name in ("sglang", "kvtier_list", "kvtier_array"):
            for key in (f"{name}_us", f"{name}_back_to_back_us"):
                assert math.isfinite(r[key]) and r[key] > 0, key
        assert r["sglang_match_back_to_back_us"] > 0
        assert r["kvtier_array_x_sglang"] == pytest.approx(r["kvtier_array_us"] / r["sglang_us"])
        assert r["kvtier_list_x_sglang"] == pytest.approx(r["kvtier_list_us"] / r["sglang_us"])


@pytest.mark.parametrize("side, name", [("sglang", "sglang"), ("kvtier", "kvtier_list")])
def test_the_comparison_checks_each_side_against_the_slots_it_inserted(api, monkeypatch, side, name):
    inserted = cache_peers._Inserted.expected

    def one_slot_off(self, of):
        slots = inserted(self, of).clone()
        if of == side:
            slots[-1] += 1
        return slots

    monkeypatch.setattr(cache_peers._Inserted, "expected", one_slot_off)
    with pytest.raises(IntegrityError, match=f"{name}: a hit of {PROMPT} tokens with {PROMPT} slots, first at token "
                                             f"{PROMPT - 1}"):
        cache_peers.compare(api, PAGE, PROMPT, 100, seed=0)


def test_a_hit_that_is_not_the_inserted_slots_is_refused():
    inserted = torch.arange(64, 128)
    cache_peers.check_hit("exact", (64, inserted.clone()), inserted)
    moved = inserted.clone()
    moved[40] = 7
    with pytest.raises(IntegrityError, match="moved: a hit of 64 tokens with 64 slots, first at token 40"):
        cache_peers.check_hit("moved", (64, moved), inserted)
    with pytest.raises(IntegrityError, match="short: a hit of 48 tokens with 48 slots; inserted: 64 slots"):
        cache_peers.check_hit("short", (48, inserted[:48]), inserted)


def test_the_command_prints_the_table_and_puts_the_rows_in_its_json(capsys):
    small = ["bench", "cache", "--page-sizes", "16", "--prompt-tokens", "256", "--tree-pages", "200"]
    assert main([*small, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["skipped"] == {}
    peer = result["sglang"]
    assert peer["version"] == cache_peers.SGLANG_VERSION and peer["rounds"] == cache_peers.ROUNDS
    assert [(r["page_size"], r["tree_pages"], r["tree_core"]) for r in peer["rows"]] == [
        (16, 196, cache_peers.RUST_CORE)]
    assert main(small) == 0
    out = capsys.readouterr().out
    assert "full hit beside sglang 0.5.23's UnifiedRadixCache (RustUnifiedTreeCore)" in out
    assert "skipped sglang" not in out
