"""The report's paired bootstrap intervals (report/tables.py `intervals`) on hand-made runs: which cells are compared,
over which clips, and the values against hand-computed corpus differences."""

from pathlib import Path

import pytest

from wnw_exp.metrics.bootstrap import paired_bootstrap_wer
from wnw_exp.report.collect import Run
from wnw_exp.report.specs import Matcher
from wnw_exp.report.tables import build_tables, intervals, table5, table7, to_markdown

WNW = {"wnw": {"n_voice": "auto", "n_anchor": "auto", "lam": "auto", "signal": "vs_hs", "selection": "segment",
               "chunk_seconds": 4.0, "stride_seconds": 2.0, "head_scores": None}}
REFS = {"c1": "a b c d", "c2": "e f g h i", "c3": "j k l"}  # 4 + 5 + 3 reference words


def run(method, retention, hyps: dict[str, str], *, cfg=None, policy=None, refs=REFS) -> Run:
    config = dict(model=dict(name="voxtral"), dataset=dict(name="librispeech_long", split="test-clean", num_shards=1),
                  method=dict(name=method, **(WNW.get(method, {}) | (cfg or {}))), retention=retention, analysis=None)
    records = [dict(id=i, reference=refs[i], hypothesis=h, task="transcribe", error=None, knobs=policy or {})
               for i, h in hyps.items()]
    overrides = {f"method.{k}": str(v) for k, v in (cfg or {}).items()}
    return Run([Path(f"/runs/{method}/{retention}/{cfg}")], config, overrides, None, records,
               dict(wer=0.0, n_samples=len(records), n_failed=0))


FULL = run("full", 1.0, dict(c1="a b c d", c2="e f g h i", c3="j k l"))
WNW_02 = run("wnw", 0.2, dict(c1="a b c x", c2="e f g h i", c3="j"), policy=dict(n_voice=90))  # 1 + 0 + 2 errors
ARK_02 = run("arkvale", 0.2, dict(c1="a b c d", c2="e f"))  # 0 + 3 errors; c3 never decoded


def rows(md: str) -> list[list[str]]:
    """The comparison rows of a Markdown table (header and section lines left out)."""
    out = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines() if line.startswith("| ")]
    return [r for r in out[1:] if not r[0].startswith("**")]


def test_table5_compares_each_method_with_full_and_its_neighbour_over_shared_clips():
    m = Matcher([FULL, WNW_02, ARK_02], WNW)
    ci = intervals(m, table5(m, ["voxtral"]))
    body = rows(to_markdown(ci))
    got = {(a, b): (d, n) for a, b, d, _, n in body}
    nv = "WnW (ours) [n_voice=90]"
    assert set(got) == {("ArkVale", "Full Cache"), (nv, "Full Cache"), (nv, "ArkVale")}
    # hand-computed corpus differences, in points, over the clips both runs scored
    assert got[(nv, "Full Cache")][1] == "3" and float(got[(nv, "Full Cache")][0].rstrip("*")) == pytest.approx(25.0, abs=0.005)
    assert got[("ArkVale", "Full Cache")][1] == "2"  # c3 is missing from ArkVale's run
    assert float(got[("ArkVale", "Full Cache")][0].rstrip("*")) == pytest.approx(100 * 3 / 9, abs=0.005)
    assert got[(nv, "ArkVale")] == (f"{100 * (1 - 3) / 9:+.2f}", "2")
    # the interval is the bootstrap's over the paired per-clip counts (c1, c2: WnW 1 and 0, ArkVale 0 and 3)
    want = paired_bootstrap_wer([1, 0], [0, 3], [4, 5])
    line = next(r for r in body if r[:2] == [nv, "ArkVale"])
    assert line[3] == f"[{want.low:+.2f}, {want.high:+.2f}]"
    assert "r_GPU=0.2" in to_markdown(ci) and "r_GPU=0.4" not in to_markdown(ci)


def test_a_clip_whose_reference_differs_is_not_paired():
    other = dict(REFS, c2="some other text")
    wnw = run("wnw", 0.2, dict(c1="a b c x", c2="e f g h i", c3="j"), policy=dict(n_voice=90), refs=other)
    m = Matcher([FULL, wnw], WNW)
    line = next(r for r in rows(to_markdown(intervals(m, table5(m, ["voxtral"])))) if r[1] == "Full Cache")
    assert line[4] == "2" and float(line[2].rstrip("*")) == pytest.approx(100 * 3 / 7, abs=0.005)  # c1 and c3 only


def test_table7_chunk_and_anchor_columns_are_separate_series():
    chunk = [run("wnw", 0.2, dict(c1="a b c d"), cfg=dict(chunk_seconds=c, stride_seconds=c / 2),
                 policy=dict(n_voice=90)) for c in (0.96, 1.92)]
    anchor = [run("wnw", 0.2, dict(c1="a"), cfg=dict(n_anchor=a), policy=dict(n_voice=90, n_anchor=a))
              for a in (1, 3)]
    m = Matcher([FULL] + chunk + anchor, WNW)
    t = table7(m, ["voxtral"])
    pairs = [(a, b) for a, b, *_ in rows(to_markdown(intervals(m, t))) if b != "Full Cache"]
    # each row's neighbour is the row above in its own column: chunk 1.92 vs 0.96, anchors 3 vs 1, never across
    assert len(pairs) == 2
    assert all(("chunk_seconds" in a) == ("chunk_seconds" in b) for a, b in pairs)


def test_every_table_with_wer_cells_gets_its_intervals():
    m = Matcher([FULL, WNW_02, ARK_02], WNW)
    keys = [t.key for t in build_tables(m, ["voxtral"])]
    assert "table5_main_ci" in keys and keys.index("table5_main_ci") == keys.index("table5_main") + 1
    assert "table4_runtime_ci" not in keys  # no WER cells
