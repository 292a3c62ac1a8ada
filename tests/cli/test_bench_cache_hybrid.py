"""``kvtier bench cache --spec``: a hybrid spec's match and request times against a
uniform cache's on the same prompts, in the same run."""

import json

import pytest

from kvtier.cli import main

SMALL = ["--page-sizes", "16", "--prompt-tokens", "256", "--tree-pages", "200"]


def run(capsys, *argv):
    code = main(["bench", "cache", *SMALL, *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_hybrid_rows_hold_both_caches_and_their_ratio(capsys):
    code, out, _ = run(capsys, "--spec", "mimo-v2-flash", "--json")
    assert code == 0
    rows = json.loads(out)["hybrid"]
    assert [r["page_size"] for r in rows] == [16]
    r = rows[0]
    assert r["spec"].startswith("full:full:0,5,11") and r["tree_prompts"] > 0
    for name in ("match", "fragmented", "request"):
        assert r[f"{name}_x_uniform"] == pytest.approx(r[f"hybrid_{name}_us"] / r[f"uniform_{name}_us"])
    assert r["fragmented_nodes"] == 256 // 16


@pytest.mark.parametrize("spec", ["gpt-oss-20b", "hybrid:layers=3,pattern=S;swa:window=32,heads=1,head_dim=8"])
def test_the_text_report_has_a_hybrid_table(capsys, spec):
    code, out, _ = run(capsys, "--spec", spec)
    assert code == 0 and "against a uniform cache" in out and "x uniform" in out


@pytest.mark.parametrize("spec, message", [
    ("llama3-8b", "takes a hybrid (sliding-window) spec"),
    ("hybrid:layers=3,pattern=F;full:heads=1,head_dim=8", "takes a hybrid (sliding-window) spec"),
])
def test_a_spec_it_cannot_compare_is_one_line(capsys, spec, message):
    code, out, err = run(capsys, "--spec", spec)
    assert code != 0 and message in err and "Traceback" not in err and not out
