"""What the report shows of each method: labels, colours and roles from the method registry (a new method shows
up in the tables and figures, the oracle as the bound), Table 5's Full Cache row as in the paper, and Figure 3:
WER on the measured r_GPU, no two labels overlapping (checked on the drawn text extents)."""

import copy

import matplotlib
import matplotlib.pyplot as plt
import pytest
from matplotlib.text import Text
from test_report import WNW_DEFAULTS, fake_run

from wnw_exp.methods import REGISTRY
from wnw_exp.methods.base import Policy
from wnw_exp.report import methods
from wnw_exp.report.figures import STYLE, draw_figure3, figure3_curves
from wnw_exp.report.specs import Matcher
from wnw_exp.report.tables import table5, to_latex, to_markdown

matplotlib.use("Agg")

# The paper's Table 5 (Voxtral-mini-3b, test-clean, r_GPU 0.8 / 0.6 / 0.4 / 0.2) and AffPool from Table 1:
# two- and three-digit WERs above the 30% cap at neighbouring retentions, the case whose labels collided.
PAPER = {"adakv": [137.46, 175.85, 196.01, 199.24], "audiokv": [6.79, 6.31, 62.51, 192.58],
         "arkvale": [6.81, 6.77, 7.12, 11.74], "wnw": [6.72, 6.71, 6.64, 6.23], "affpool": [6.47, 10.04, 67.08, 111.63]}
WNW_MEASURED = {0.8: 0.7979, 0.6: 0.5996, 0.4: 0.4091, 0.2: 0.2225}  # Table 5's measured r_GPU of WnW
DEFAULTS = dict(WNW_DEFAULTS, oracle=dict(granularity="token", chunk_seconds=4.0))


def paper_runs(model: str = "voxtral") -> list:
    runs = [fake_run("full", 1.0, 6.79, model=model)]
    for method, wers in PAPER.items():
        for r, wer in zip((0.8, 0.6, 0.4, 0.2), wers):
            run = fake_run(method, r, wer, model=model,
                           policy=dict(n_voice={0.8: 30, 0.6: 30, 0.4: 50, 0.2: 90}[r]) if method == "wnw" else None)
            if method == "wnw":
                run.metrics["r_gpu"] = WNW_MEASURED[r]
            runs.append(run)
    for gran, wers in (("token", [6.75, 6.8, 6.9, 7.0]), ("chunk", [6.8, 6.9, 7.2, 8.1])):
        for r, wer in zip((0.8, 0.6, 0.4, 0.2), wers):
            runs.append(fake_run("oracle", r, wer, model=model, cfg=dict(granularity=gran, chunk_seconds=4.0),
                                 overrides={"method.granularity": gran} if gran == "chunk" else None))
    return runs


def test_styles_come_from_the_registry():
    styles = {s.name: s for s in methods.method_styles()}
    assert set(styles) == set(REGISTRY)
    assert [s.name for s in methods.method_styles()][:6] == list(methods.PAPER_METHODS)
    assert methods.method_styles()[-1].name == "oracle"  # bounds last
    assert styles["full"].role == "reference" and styles["wnw"].role == "ours" and styles["oracle"].role == "bound"
    assert not styles["oracle"].deployable and styles["adakv"].deployable
    assert len({s.color for s in styles.values()}) == len(styles)  # every method its own colour


def test_a_new_method_shows_up_in_tables_and_figures(monkeypatch):
    """A new policy file (here a class registered on the fly) is enough: its own label and colour, or its class
    name and a free colour, in Table 5, Figure 3 and Figure 4's method list."""

    class SnapKV(Policy):
        name = "snapkv"

    class Quest(Policy):
        name = "quest"
        label = "Quest (page recall)"
        color = "tab:cyan"

    monkeypatch.setitem(REGISTRY, "snapkv", SnapKV)
    monkeypatch.setitem(REGISTRY, "quest", Quest)
    styles = {s.name: s for s in methods.method_styles()}
    assert styles["snapkv"].label == "SnapKV" and styles["snapkv"].role == "method"
    assert styles["snapkv"].color not in {s.color for n, s in styles.items() if n != "snapkv"}
    assert styles["quest"].label == "Quest (page recall)" and styles["quest"].color == "tab:cyan"
    assert [s.name for s in methods.method_styles()][-1] == "oracle"
    runs = paper_runs() + [fake_run("snapkv", 0.2, 42.0)]
    m = Matcher(runs, DEFAULTS)
    md = to_markdown(table5(m, ["voxtral"]))
    assert "| SnapKV |  |  |  | 42.00 |" in md and "| Quest (page recall) |" in md
    curves, _ = figure3_curves(m, "voxtral")
    assert [c.points for c in curves if c.style.name == "snapkv"] == [[(0.2, 0.2, 42.0)]]


def test_table5_full_row_and_the_oracle_bound():
    t = table5(Matcher(paper_runs(), DEFAULTS), ["voxtral"])
    md = to_markdown(t)
    # Full Cache: one value per test set across its r_GPU columns (the paper's one spanning cell)
    assert "| Full Cache | 6.79 | 6.79 | 6.79 | 6.79 |  |  |  |  |" in md
    assert r"Full Cache & \multicolumn{4}{c}{6.79} & \multicolumn{4}{c}{} \\" in to_latex(t)
    # the bound in its own section, both granularities, after the deployable methods
    lines = md.splitlines()
    bound = next(i for i, ln in enumerate(lines) if "Upper bound" in ln)
    assert next(i for i, ln in enumerate(lines) if ln.startswith("| WnW (ours)")) < bound
    assert lines[bound + 1] == "| Oracle, top tokens (bound) | 6.75 | 6.80 | 6.90 | 7.00 |  |  |  |  |"
    assert lines[bound + 2] == "| Oracle, top 4 s blocks (bound) | 6.80 | 6.90 | 7.20 | 8.10 |  |  |  |  |"
    assert "AffPool" not in md  # AffPool is Table 1's, as in the paper


def drawn_text(fig) -> list[tuple[str, object]]:
    """(text, window extent) of every text the figure really draws (ticks outside the view, hidden axes and empty
    strings are not drawn), recorded while drawing."""
    drawn = []
    draw = Text.draw

    def record(self, renderer):
        draw(self, renderer)
        if self.get_visible() and self.get_text().strip():
            drawn.append((self.get_text(), self.get_window_extent(renderer)))

    Text.draw = record
    try:
        fig.canvas.draw()
    finally:
        Text.draw = draw
    return drawn


def overlaps(drawn) -> list[tuple[str, str]]:
    return [(a, b) for i, (a, ba) in enumerate(drawn) for b, bb in drawn[i + 1:] if ba.overlaps(bb)]


def test_figure3_on_measured_retention_without_overlapping_labels():
    runs = paper_runs("voxtral") + paper_runs("qwen_omni")
    m = Matcher(runs, DEFAULTS)
    with plt.rc_context(STYLE):
        fig = draw_figure3(m, ["voxtral", "qwen_omni"])
        try:
            drawn = drawn_text(fig)
            texts = [t for t, _ in drawn]
            assert overlaps(drawn) == []
            # the off-scale values are all there, once per panel
            for wer in (137.46, 175.85, 196.01, 199.24, 62.51, 192.58, 67.08, 111.63):
                assert texts.count(f"{wer:.0f}") == 2
            assert {"Oracle, top tokens (bound)", "Oracle, top 4 s blocks (bound)", "Full Cache"} <= set(texts)
            # WnW's markers sit at the measured r_GPU, not at the target
            panel = fig.axes[0]
            xs = sorted(x for line in panel.get_lines() if line.get_color() == "tab:green" and line.get_marker() == "o"
                        for x in line.get_xdata())
            assert xs == pytest.approx(sorted(WNW_MEASURED.values()))
            # the targets are marked: a dotted vertical at each
            verticals = sorted(line.get_xdata()[0] for line in panel.get_lines()
                               if len(set(line.get_xdata())) == 1 and line.get_color() == "0.75")
            assert verticals == pytest.approx([0.2, 0.4, 0.6, 0.8])
        finally:
            plt.close(fig)


def test_the_overlap_check_sees_colliding_labels():
    """The check the figure test relies on: the old labels beside the arrows ('60' and '98' at neighbouring
    arrows) are caught."""
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(3.4, 2.3))
        ax.set_xlim(0.13, 0.87)
        for x, v in ((0.2 - 0.006, 60), (0.2 + 0.006, 98)):
            ax.text(x, 33, f"{v}", fontsize=6, ha="center")
        ax.set_ylim(0, 39)
        try:
            assert ("60", "98") in overlaps(drawn_text(fig))
        finally:
            plt.close(fig)


def test_figure3_single_panel_without_offscale_points():
    runs = [r for r in paper_runs() if r.method in ("full", "wnw", "arkvale")]
    with plt.rc_context(STYLE):
        fig = draw_figure3(Matcher(copy.deepcopy(runs), DEFAULTS), ["voxtral"])
        try:
            assert len(fig.axes) == 1  # no table when nothing is off the scale
            assert overlaps(drawn_text(fig)) == []
        finally:
            plt.close(fig)
