"""Figures 1, 3 and 4 from runs (matplotlib, PNG and PDF), sized for a paper column or page.

- Figure 1: prefill vs decode-cumulative attention over the audio, (a) mass per grid bin, (b) cumulative.
- Figure 3: WER vs the measured r_GPU per method (the targets as dotted verticals), one panel per backbone,
  Full Cache dashed, the oracle bound dotted grey; points above the cap are upward arrows at the cap, their
  values in a small table under the panel.
- Figure 4: GPU KV size over decode steps on one sample, one panel per method, one curve per target
  r_GPU, the reference length dotted.
Each function returns the paths it wrote (none when there is nothing to draw).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from wnw_exp.report.collect import Run  # noqa: E402
from wnw_exp.report.mismatch import MismatchSummary  # noqa: E402
from wnw_exp.report.methods import MethodStyle, Variant, method_styles, style  # noqa: E402
from wnw_exp.report.specs import MAIN_RETENTIONS, PAPER_MODELS, Cell, Matcher  # noqa: E402
from wnw_exp.report.tables import n_voice_knob  # noqa: E402

STYLE = {"font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8, "legend.fontsize": 7, "xtick.labelsize": 7,
         "ytick.labelsize": 7, "lines.linewidth": 1.3, "lines.markersize": 4, "savefig.dpi": 200}
RET_COLORS = {0.2: "tab:red", 0.4: "tab:orange", 0.6: "tab:blue", 0.8: "tab:green"}
WER_CAP = 30.0


def _save(fig, out_dir: Path, stem: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.pdf"]
    for p in paths:
        fig.savefig(p, bbox_inches="tight")
    plt.close(fig)
    return paths


def _model_title(model: str) -> str:
    return PAPER_MODELS.get(model, f"{model} (stand-in)")


# --- Figure 1 ---------------------------------------------------------------------------------------------
def figure1(summary: MismatchSummary, out_dir: Path, stem: str) -> list[Path]:
    run = summary.run
    bins = summary.prefill_grid.size
    x = (np.arange(bins) + 0.5) / bins * 100
    with plt.rc_context(STYLE):
        fig, (a, b) = plt.subplots(1, 2, figsize=(6.5, 2.3))
        a.plot(x, 100 * summary.prefill_grid, color="tab:red", label="Prefill (first answer token)")
        a.plot(x, 100 * summary.decode_grid, color="tab:blue", label="Decode (cumulative)")
        a.axhline(100 / bins, color="gray", lw=0.8, ls=":", label="uniform")
        a.set_xlabel("audio position (% of the clip)")
        a.set_ylabel(f"attention mass per bin (%), {bins} bins")
        a.set_title("(a) per-position mass")
        a.legend(frameon=False)
        edges = np.linspace(0, 100, bins + 1)
        b.plot(edges, 100 * np.concatenate([[0], np.cumsum(summary.prefill_grid)]), color="tab:red", label="Prefill")
        b.plot(edges, 100 * np.concatenate([[0], np.cumsum(summary.decode_grid)]), color="tab:blue",
               label="Decode (cumulative)")
        b.plot([0, 100], [0, 100], color="gray", lw=0.8, ls=":", label="uniform")
        b.set_xlabel("audio position (% of the clip)")
        b.set_ylabel("cumulative mass (%)")
        b.set_title("(b) cumulative mass")
        b.legend(frameon=False, loc="lower right")
        for ax in (a, b):
            ax.set_xlim(0, 100)
            ax.grid(alpha=0.3)
        fig.suptitle(f"{_model_title(run.model)}, {run.dataset}-{run.split}, {run.method}: mean over "
                     f"{summary.n_samples} samples (mean T_a = {summary.mean_t_audio:.0f})", fontsize=8)
        fig.tight_layout()
        return _save(fig, out_dir, stem)


# --- Figure 3 ---------------------------------------------------------------------------------------------
def _wer_series(matcher: Matcher, model: str, method: str, role: str,
                knobs: tuple = ()) -> list[tuple[float, float, float]]:
    """(target, measured r_GPU, WER) of a method's runs at the paper's retentions, by target. A run that did not
    record r_GPU is drawn at its target; an incomplete one (interrupted, shards missing) is left out: a figure
    has no mark for it (the tables show it with ‡)."""
    pts = []
    for r in MAIN_RETENTIONS:
        run, _ = matcher.find(Cell(model, role, method, r, knobs + (n_voice_knob(model, r) if method == "wnw" else ())))
        if run is not None and run.complete and run.metrics.get("wer") is not None:
            measured = run.metrics.get("r_gpu")
            pts.append((r, r if measured is None else float(measured), float(run.metrics["wer"])))
    return sorted(pts)


@dataclass
class Curve:
    style: MethodStyle
    variant: Variant
    points: list[tuple[float, float, float]]  # (target, measured r_GPU, WER)


def figure3_curves(matcher: Matcher, model: str, role: str = "test-clean") -> tuple[list[Curve], float | None]:
    """The curves of one panel (every deployable method, then the bounds) and Full Cache's WER."""
    curves = []
    for st in method_styles():
        if st.role == "reference":
            continue
        for v in st.rows():
            pts = _wer_series(matcher, model, st.name, role, v.knobs)
            if pts:
                curves.append(Curve(st, v, pts))
    full, _ = matcher.find(Cell(model, role, "full", None))
    return curves, None if full is None else full.metrics.get("wer")


def figure3(matcher: Matcher, models: list[str], out_dir: Path, stem: str = "figure3_wer_vs_retention",
            role: str = "test-clean", cap: float = WER_CAP) -> list[Path]:
    with plt.rc_context(STYLE):
        fig = draw_figure3(matcher, models, role, cap)
        return [] if fig is None else _save(fig, out_dir, stem)


def draw_figure3(matcher: Matcher, models: list[str], role: str = "test-clean", cap: float = WER_CAP):
    """WER against the *measured* r_GPU (the targets as grey verticals); points above the cap are upward arrows
    at the cap, their values in a table under the panel (labels beside arrows collide at 2-3 digits). None when
    no model has a point."""
    panels = []
    for model in models:
        curves, full_wer = figure3_curves(matcher, model, role)
        if full_wer is not None or curves:
            panels.append((model, curves, full_wer))
    if not panels:
        return None
    tops, offscale = [], []
    for _, curves, full_wer in panels:
        # the cap: the paper's 30% WER, raised for a model whose Full Cache is itself above 2/3 of it
        top = cap if full_wer is None or full_wer < cap * 2 / 3 else float(np.ceil(1.5 * full_wer / 10) * 10)
        tops.append(top)
        offscale.append([c for c in curves if any(w > top for _, _, w in c.points)])
    heights = []
    for rows in offscale:
        heights += [2.0] + ([0.16 * (len(rows) + 1) + 0.05] if rows else [])
    fig = plt.figure(figsize=(3.4, sum(heights) + 0.3 * len(panels)))
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights)
    row = 0
    for (model, curves, full_wer), top, rows in zip(panels, tops, offscale):
        ax = fig.add_subplot(grid[row])
        row += 1
        _figure3_panel(ax, model, curves, full_wer, top, matcher, role)
        if rows:
            _offscale_table(fig.add_subplot(grid[row], sharex=ax), rows, top)
            row += 1
    handles: dict[str, Any] = {}
    for ax in fig.axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            full = style("full").label  # one legend entry for every panel's Full Cache line (its WER differs)
            handles.setdefault(full if lab.startswith(f"{full} (") else lab, h)
    fig.tight_layout(h_pad=0.6)
    fig.legend(handles.values(), handles.keys(), loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2,
               frameon=False)
    return fig


def _figure3_panel(ax, model: str, curves: list[Curve], full_wer: float | None, top: float, matcher: Matcher,
                   role: str) -> None:
    targets = sorted({t for c in curves for t, _, _ in c.points} or MAIN_RETENTIONS)
    for t in targets:
        ax.axvline(t, color="0.75", lw=0.7, ls=(0, (1, 2)), zorder=0)
    if full_wer is not None:
        full = style("full")
        ax.axhline(full_wer, color=full.color, ls="--", lw=1, label=f"{full.label} ({full_wer:.2f})")
    arrows = [c for c in curves if any(w > top for _, _, w in c.points)]
    for c in curves:
        st = c.style
        xs = np.array([p[1] for p in c.points])
        ys = np.array([p[2] for p in c.points])
        below = ys <= top
        # off-scale arrows of one target side by side (their x is the measured r_GPU plus this offset)
        dx = (arrows.index(c) - (len(arrows) - 1) / 2) * 0.012 if c in arrows else 0.0
        xplot = np.where(below, xs, xs + dx)
        bound = st.role == "bound"
        kw = dict(color=st.color, lw=1.0 if bound else 1.1, ls=c.variant.linestyle)
        ax.plot(xplot, np.minimum(ys, top), **kw)
        ax.plot(xs[below], ys[below], ls="none", color=st.color, marker=st.marker)
        ax.plot([], [], marker=st.marker, label=c.variant.label, **kw)  # legend entry
        for x in xplot[~below]:
            ax.annotate("", xy=(x, top * 1.1), xytext=(x, top * 0.95),
                        arrowprops=dict(arrowstyle="-|>", color=st.color, lw=1.2, mutation_scale=7))
    measured = [x for c in curves for _, x, _ in c.points]
    lo, hi = min(measured + targets) - 0.07, max(measured + targets) + 0.07
    ax.set_xlim(max(0.0, lo), min(1.02, hi))
    ax.set_ylim(0, top * 1.15)
    ax.set_xticks(targets)
    ax.set_xlabel("audio KV retention r_GPU, measured (dotted verticals: targets)")
    ax.set_ylabel("WER (%)")
    data = role if model in PAPER_MODELS else matcher.data_for(model, role)
    ax.set_title(f"{_model_title(model)}, {data}" + (f": arrows > {top:.0f}% WER" if arrows else ""))
    ax.grid(alpha=0.3, axis="y")


def _offscale_table(ax, curves: list[Curve], top: float) -> None:
    """The values of the off-scale points under the panel: one row per curve, each value under its point's
    target on the panel's x-axis (`ax` shares it), the curve's label at the left."""
    ax.axis("off")
    n = len(curves)
    ax.set_ylim(n + 0.5, -0.7)
    ax.text(-0.02, -0.3, f"WER (%) above {top:.0f}:", transform=ax.get_yaxis_transform(), ha="right", va="center",
            fontsize=6, style="italic")
    for i, c in enumerate(curves):
        y = i + 0.6
        ax.text(-0.02, y, c.variant.label, transform=ax.get_yaxis_transform(), ha="right", va="center", fontsize=6,
                color=c.style.color)
        for t, _, w in c.points:
            if w > top:
                ax.text(t, y, f"{w:.0f}", ha="center", va="center", fontsize=6, color=c.style.color)


# --- Figure 4 ---------------------------------------------------------------------------------------------
def _kv_curve(run: Run, sample_id: str) -> tuple[np.ndarray, dict] | None:
    """GPU KV size per decode step in MB (audio on the device + every text/generated token in all layers
    and KV heads), or in thousands of KV entries when the run did not record bytes."""
    tr = run.trace(sample_id)
    rec = next((r for r in run.records if r["id"] == sample_id), None)
    if tr is None or rec is None or not tr.get("gpu_audio_tokens"):
        return None
    gpu = np.asarray(tr["gpu_audio_tokens"], dtype=float)
    n_audio, n_full = tr.get("n_audio"), tr.get("n_full")
    if not n_audio or not n_full:
        return None
    heads = n_full / n_audio  # L * H_kv
    text = heads * (tr.get("n_prompt_text", 0) + np.arange(1, gpu.size + 1))
    entries = gpu + text
    bytes_on_device = rec.get("audio_bytes_on_device")
    per_entry = bytes_on_device / gpu[-1] if bytes_on_device and gpu[-1] > 0 else None
    ref = tr.get("reference_tokens") or tr.get("reference_words")
    info = dict(unit="MB" if per_entry else "k entries", ref=ref,
                ref_unit="tokens" if tr.get("reference_tokens") else "words", per_entry=per_entry)
    return (entries * per_entry / 1e6 if per_entry else entries / 1e3), info


def figure4(matcher: Matcher, model: str, out_dir: Path, stem: str, role: str = "test-clean",
            sample_id: str | None = None) -> list[Path]:
    runs: dict[tuple[str, float | None], Run] = {}
    full_run, _ = matcher.find(Cell(model, role, "full", None))
    if full_run is not None:
        runs[("full", None)] = full_run
    labels = {st.name: st.label for st in method_styles() if st.deployable}
    for m in labels:
        for r in MAIN_RETENTIONS:
            run, _ = matcher.find(Cell(model, role, m, r, n_voice_knob(model, r) if m == "wnw" else ()))
            if run is not None:
                runs[(m, r)] = run
    runs = {k: r for k, r in runs.items() if r.trace_ids()}  # a run whose samples all failed has no curve
    methods = [m for m in labels if any(k[0] == m for k in runs)]
    if not methods:
        return []
    if sample_id is None:  # the sample most runs decoded, the longest among those
        count: dict[str, int] = {}
        for r in runs.values():
            for sid in r.trace_ids():
                count[sid] = count.get(sid, 0) + 1
        dur = {rec["id"]: rec.get("duration") or 0 for r in runs.values() for rec in r.records}
        sample_id = max(sorted(count), key=lambda s: (count[s], dur.get(s, 0)))
    full = runs.get(("full", None))
    full_curve = _kv_curve(full, sample_id) if full is not None else None
    per_entry = full_curve[1]["per_entry"] if full_curve else None
    cols = min(3, len(methods))
    rows = int(np.ceil(len(methods) / cols))
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(rows, cols, figsize=(2.4 * cols, 2.0 * rows), squeeze=False, sharey=True)
        ref, unit, ref_unit = None, "MB", "tokens"
        for ax, m in zip(axes.flat, methods):
            if full_curve is not None:
                ax.plot(np.arange(full_curve[0].size), full_curve[0], color=style("full").color, ls="--", lw=1,
                        label=style("full").label)
            for r in MAIN_RETENTIONS:
                if (m, r) not in runs:
                    continue
                c = _kv_curve(runs[(m, r)], sample_id)
                if c is None:
                    continue
                y, info = c
                if per_entry and info["per_entry"] is None:  # same model: the Full run's bytes per entry
                    y = y * 1e3 * per_entry / 1e6
                    info["unit"] = "MB"
                ref, unit, ref_unit = info["ref"], info["unit"], info["ref_unit"]
                ax.plot(np.arange(y.size), y, color=RET_COLORS[r], label=f"r={r:g}")
            if ref:
                ax.axvline(ref, color="gray", ls=":", lw=1)
            ax.set_title(labels[m])
            ax.grid(alpha=0.3)
            ax.set_xlabel("decode step")
            ax.set_ylim(bottom=0)
        for ax in axes[:, 0]:
            ax.set_ylabel(f"GPU KV size ({unit})")
        for ax in list(axes.flat)[len(methods):]:
            ax.axis("off")
        handles = {}
        for ax in axes.flat:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(lab, h)
        dur = next((rec.get("duration") for r in runs.values() for rec in r.records if rec["id"] == sample_id), None)
        fig.suptitle(f"{_model_title(model)}: sample {sample_id}" + (f" ({dur:.0f} s)" if dur else "")
                     + (f"; dotted: reference length ({ref} {ref_unit})" if ref else ""), fontsize=8)
        fig.tight_layout()
        fig.legend(handles.values(), handles.keys(), loc="upper center", bbox_to_anchor=(0.5, 0.0),
                   ncol=len(handles), frameon=False)
        return _save(fig, out_dir, stem)
