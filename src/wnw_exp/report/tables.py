"""The paper's tables (1-8) and the §2.1 mismatch numbers from runs, as Markdown and LaTeX.

Each `table_*` function lays out one paper table with `Cell`s (see `specs.py` for how a cell finds its
run). A cell without a run is blank and listed in `Table.missing`; every value shown is read from a run.
Values carry a mark when the run is not clean: † some samples failed, ‡ the run is incomplete (some shards, or
some of the samples its configuration selects, are missing: an interrupted run).

Every table with WER cells has a companion `<key>_ci` (`intervals`): for each WER cell, the paired bootstrap 95%
interval (`metrics.bootstrap`) of its corpus WER minus Full Cache's, and minus the cell above it in the same column
(its neighbouring method or setting), over the clips both runs scored (paired by sample id, the count shown).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from wnw_exp.metrics.bootstrap import PairedDiff, paired_bootstrap_wer
from wnw_exp.metrics.text import wer_counts
from wnw_exp.report.collect import Run
from wnw_exp.report.methods import label, table_methods
from wnw_exp.report.specs import MAIN_RETENTIONS, PAPER_MODELS, PAPER_N_VOICE, Cell, Matcher, same

FAILED_MARK, INCOMPLETE_MARK = "†", "‡"


@dataclass
class Out:
    """One rendered cell: text, how many columns it spans, and whether it is a header-like label."""

    text: str
    span: int = 1


@dataclass
class Table:
    key: str  # file stem, e.g. "table5_main"
    title: str
    columns: list[str]  # one header per column (label columns included)
    groups: list[tuple[str, int]] | None = None  # a header row above: (text, columns spanned)
    rows: list[list[Out] | str] = field(default_factory=list)  # a str is a section line
    notes: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    n_cells: int = 0
    n_labels: int = 1  # leading label columns (left-aligned)
    # WER cells with a run, in the order filled: (column key, cell, run); `intervals` compares within a column
    compared: list[tuple[tuple, Cell, Run]] = field(default_factory=list)

    @property
    def n_filled(self) -> int:
        return self.n_cells - len(self.missing)


def fmt(value: Any, metric: str) -> str:
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return ""
    if metric in ("r_gpu", "r_gpu_cpu", "r_gpu_end", "r_gpu_cpu_end"):
        return f"{100 * value:.2f}"
    if metric == "ms_per_token":
        return f"{value:.1f}"
    if metric in ("wer", "bleu", "mb_per_step"):
        return f"{value:.2f}"
    return str(value)


class Builder:
    """Fills cells of one table from the matcher, keeping the missing list and the notes."""

    def __init__(self, matcher: Matcher, table: Table):
        self.m, self.t = matcher, table
        self.chosen: dict[Cell, Run] = {}

    def run(self, cell: Cell) -> Run | None:
        run, n = self.m.find(cell)
        if run is not None and n > 1 and (cell.retention is not None or self._tied_full(cell, run)):
            self.t.notes.append(f"{cell.describe()}: {n} runs match; used {run.label}")
        if run is not None:
            self.chosen[cell] = run
        return run

    def _tied_full(self, cell: Cell, run: Run) -> bool:
        """Full Cache runs at several retentions are expected (`full` ignores it); note only a tie."""
        return sum(same(r.retention, run.retention) for r in self.m.candidates(cell)) > 1

    def value(self, cell: Cell, span: int = 1, series: str | None = None) -> Out:
        """The cell's value as text. `series` names the column's run of rows whose neighbours are compared (default:
        the rows since the table's last section line)."""
        self.t.n_cells += 1
        run = self.run(cell)
        if run is None:
            why = "no stand-in data set for this role" if self.m.data_for(cell.model, cell.role) is None else "no run"
            self.t.missing.append(f"{cell.describe()} [{cell.value}]: {why}")
            return Out("", span)
        v = run.metrics.get(cell.value)
        if v is None:
            self.t.missing.append(f"{cell.describe()} [{cell.value}]: the run has no {cell.value} ({run.label})")
            return Out("", span)
        mark = (FAILED_MARK if run.metrics.get("n_failed") else "") + ("" if run.complete else INCOMPLETE_MARK)
        if cell.value == "wer":
            section = series if series is not None else sum(isinstance(r, str) for r in self.t.rows)
            self.t.compared.append(((cell.model, cell.role, cell.retention, section), cell, run))
        return Out(fmt(v, cell.value) + mark, span)


def model_label(model: str) -> str:
    return PAPER_MODELS.get(model, f"{model} (stand-in)")


def _stand_in_notes(matcher: Matcher, models: list[str], roles: list[str]) -> list[str]:
    notes = []
    for m in models:
        if m in PAPER_MODELS:
            continue
        mapped = [f"{r} <- {matcher.data_for(m, r)}" for r in roles if matcher.data_for(m, r) is not None]
        unmapped = [r for r in roles if matcher.data_for(m, r) is None]
        notes.append(f"{m} stands in for the paper's backbone; data: " + (", ".join(mapped) or "none mapped")
                     + (f"; no stand-in for {', '.join(unmapped)}" if unmapped else ""))
    return notes


def _marks_note(t: Table) -> None:
    t.notes.append(f"{FAILED_MARK}: the run has failed samples (metrics over the others); "
                   f"{INCOMPLETE_MARK}: the run is incomplete (shards or selected samples missing).")


def n_voice_knob(model: str, r: float) -> tuple[tuple[str, Any], ...]:
    nv = PAPER_N_VOICE.get(model, {}).get(r)
    return (("n_voice", nv),) if nv is not None else ()


# --- Table 5: main results ----------------------------------------------------------------------------
TABLE5_METHODS = ("adakv", "audiokv", "arkvale", "wnw")  # the paper's rows under Full Cache


def table5(matcher: Matcher, models: list[str]) -> Table:
    roles = ["test-clean", "test-other"]
    rs = MAIN_RETENTIONS
    t = Table("table5_main", "Table 5: Full LibriSpeech-Long results across backbones. Truncated WER (ratio 1.2); "
              "the bottom rows of each block are WnW's measured r_GPU and r_GPU+CPU (%).",
              ["Method (r_GPU=)"] + [f"{role} {r:g}" for role in roles for r in rs],
              groups=[("", 1)] + [(f"{role} (WER)", len(rs)) for role in roles])
    b = Builder(matcher, t)
    methods = table_methods(TABLE5_METHODS, bounds=True)
    for model in models:
        t.rows.append(f"Backbone: {model_label(model)}")
        full = [Out(label("full"))]
        for role in roles:  # Full Cache keeps every audio position: one value per test set, across its columns
            full.append(b.value(Cell(model, role, "full", None), span=len(rs)))
        t.rows.append(full)
        bounds = [m for m in methods if m.role == "bound"]
        for m in [m for m in methods if m.role != "bound"]:
            t.rows.append(_retention_row(b, model, roles, m.name, m.label))
        if bounds:  # one series with the methods above: the last method's neighbour is the first bound
            t.rows.append("Upper bound (not deployable: every step's true attention)")
            for m in bounds:
                for v in m.rows():
                    t.rows.append(_retention_row(b, model, roles, m.name, v.label, v.knobs))
        t.rows.append("Measured audio KV retention")
        for metric, text in (("r_gpu", "WnW r_GPU (%)"), ("r_gpu_cpu", "WnW r_GPU+CPU (%)")):
            row = [Out(text)]
            for role in roles:
                for r in rs:
                    row.append(b.value(Cell(model, role, "wnw", r, n_voice_knob(model, r), value=metric)))
            t.rows.append(row)
    t.notes += _stand_in_notes(matcher, models, roles)
    t.notes.append("Full Cache keeps every audio position, so it has one run per test set; its value spans the "
                   "r_GPU columns (one cell in the LaTeX table, repeated here), as in the paper.")
    _marks_note(t)
    return t


def _retention_row(b: Builder, model: str, roles: list[str], method: str, text: str,
                   knobs: tuple[tuple[str, Any], ...] = ()) -> list[Out]:
    row = [Out(text)]
    for role in roles:
        for r in MAIN_RETENTIONS:
            wnw = n_voice_knob(model, r) if method == "wnw" else ()
            row.append(b.value(Cell(model, role, method, r, knobs + wnw), series="methods"))
    return row


# --- Table 1: AffPool -----------------------------------------------------------------------------------
def table1(matcher: Matcher, models: list[str]) -> Table:
    t = Table("table1_affpool", "Table 1: Comparison with a token-merging efficiency baseline on LibriSpeech-Long. "
              "Truncated WER (ratio 1.2).", ["Method", "Category", "Retention", "clean", "other"], n_labels=3)
    b = Builder(matcher, t)
    for model in models:
        if len(models) > 1:
            t.rows.append(f"Backbone: {model_label(model)}")
        spec = [("full", "—", "100%", None), ("wnw", "KV recall", "~20%", 0.2)] + \
               [("affpool", "token merging", f"{int(r * 100)}%", r) for r in (0.2, 0.4, 0.6, 0.8)]
        for method, cat, ret, r in spec:
            knobs = n_voice_knob(model, r) if method == "wnw" else ()
            t.rows.append([Out(label(method).replace(" (ours)", "")), Out(cat), Out(ret)]
                          + [b.value(Cell(model, role, method, r, knobs)) for role in ("test-clean", "test-other")])
    t.notes += _stand_in_notes(matcher, models, ["test-clean", "test-other"])
    _marks_note(t)
    return t


# --- Table 2: generalisation ----------------------------------------------------------------------------
def table2(matcher: Matcher, models: list[str]) -> Table:
    cols = [("asr-fr", "wer", "asr-fr WER"), ("en2fr", "bleu", "en2fr BLEU"), ("primock57", "wer", "PriMock57 WER")]
    t = Table("table2_generalisation", "Table 2: Generalisation and domain robustness at r_GPU=0.2 (LongSpeech asr-fr "
              "and en2fr, PriMock57). Truncated WER (ratio 1.2), sacreBLEU for en2fr.",
              ["Method", "r_GPU"] + [c[2] for c in cols], n_labels=2)
    b = Builder(matcher, t)
    for model in models:
        if len(models) > 1:
            t.rows.append(f"Backbone: {model_label(model)}")
        for method in (m.name for m in table_methods(("full", "adakv", "audiokv", "arkvale", "wnw"))):
            r = None if method == "full" else 0.2
            knobs = n_voice_knob(model, 0.2) if method == "wnw" else ()
            t.rows.append([Out(label(method)), Out("100%" if r is None else "~20%")]
                          + [b.value(Cell(model, role, method, r, knobs, value=v)) for role, v, _ in cols])
        for role, _, _ in cols:  # the caption's measured retention of WnW, where the run exists
            run = b.chosen.get(Cell(model, role, "wnw", 0.2, n_voice_knob(model, 0.2), value="wer" if role != "en2fr"
                                    else "bleu"))
            if run is not None and run.metrics.get("r_gpu") is not None:
                t.notes.append(f"{model} WnW measured on {role}: r_GPU={100 * run.metrics['r_gpu']:.2f}% / "
                               f"r_GPU+CPU={100 * (run.metrics.get('r_gpu_cpu') or 0):.2f}%")
    t.notes += _stand_in_notes(matcher, models, [c[0] for c in cols])
    _marks_note(t)
    return t


# --- Table 3: ablations A1-A3 ---------------------------------------------------------------------------
def _axis(matcher: Matcher, model: str, paper: list, role: str, method: str, rs: tuple[float, ...], knob: str,
          table: Table | None = None) -> list:
    """The rows of a knob sweep: the paper's values for a paper backbone, the values run for a stand-in."""
    if model in PAPER_MODELS:
        return list(paper)
    values = matcher.present_values(model, role, method, rs, knob)
    if not values and table is not None:
        table.notes.append(f"{model}: no {method} run at r_GPU={'/'.join(f'{r:g}' for r in rs)} records {knob}; "
                           "a stand-in's rows are the values it was run with")
    return values


def table3(matcher: Matcher, models: list[str]) -> Table:
    t = Table("table3_ablations", "Table 3: Ablations on LibriSpeech-Long test-clean (truncated WER, ratio 1.2). "
              "A1: voice-head count; A2: prefill selection; A3: triage signal.", ["Setting", "Col. 1", "Col. 2"])
    b = Builder(matcher, t)
    role = "test-clean"
    for model in models:
        paper = model in PAPER_MODELS
        prefix = f"{model_label(model)}: " if len(models) > 1 else ""
        t.rows.append(f"{prefix}(A1) Voice-head count n_voice | r_GPU=0.1 | r_GPU=0.2")
        for nv in _axis(matcher, model, [10, 30, 50, 70, 90], role, "wnw", (0.1, 0.2), "n_voice", t):
            t.rows.append([Out(str(nv))] + [b.value(Cell(model, role, "wnw", r, (("n_voice", nv),)))
                                            for r in (0.1, 0.2)])
        # A2: per-segment vs global at nv30/0.1 and nv90/0.2 (stand-ins: their default n_voice)
        points = [(30, 0.1), (90, 0.2)] if paper else [(None, 0.1), (None, 0.2)]
        head = " | ".join(f"nv{nv}/{r:g}" if nv else f"auto/{r:g}" for nv, r in points)
        t.rows.append(f"{prefix}(A2) Prefill selection | {head}")
        for sel, name in (("segment", "per-segment (ours)"), ("global", "global top-k")):
            row = [Out(name)]
            for nv, r in points:
                knobs = (("selection", sel),) + ((("n_voice", nv),) if nv else ())
                row.append(b.value(Cell(model, role, "wnw", r, knobs)))
            t.rows.append(row)
        nv, r = points[0]
        t.rows.append(f"{prefix}(A3) Triage signal at {'nv30' if nv else 'auto'}/r_GPU={r:g} | WER | ")
        for sig, name in (("vs_hs", "VS x HS (ours)"), ("hs", "HS only"), ("vs", "VS only")):
            knobs = (("signal", sig),) + ((("n_voice", nv),) if nv else ())
            t.rows.append([Out(name), b.value(Cell(model, role, "wnw", r, knobs)), Out("")])
    t.notes += _stand_in_notes(matcher, models, [role])
    t.notes.append("A sub-table's header line names its columns. A2's per-segment cells are the A1 runs at the "
                   "same point; A1 at r=0.2, n_voice=90 is also Table 5's WnW run.")
    _marks_note(t)
    return t


# --- Table 4: runtime vs tidal heads --------------------------------------------------------------------
def table4(matcher: Matcher, models: list[str]) -> Table:
    t = Table("table4_runtime", "Table 4: Runtime impact of CPU->GPU recall at ~20% GPU retention, LibriSpeech-Long "
              "test-clean. Decode time is median ms/token; MB/step is CPU->GPU KV transfer per decode step.",
              ["Config.", "r_GPU (%)", "ms/token", "MB/step"])
    b = Builder(matcher, t)
    role = "test-clean"
    for model in models:
        if len(models) > 1:
            t.rows.append(f"Backbone: {model_label(model)}")
        paper_tidal = [35, 75, 115, 155, 195, 235] if model == "voxtral" else []
        for tidal in _axis(matcher, model, paper_tidal, role, "wnw", (0.2,), "n_tidal", t):
            cell = dict(model=model, role=role, method="wnw", retention=0.2, knobs=(("n_tidal", tidal),),
                        free=("n_voice",))
            t.rows.append([Out(f"{tidal} tidal heads")] + [b.value(Cell(**cell, value=v))
                                                           for v in ("r_gpu", "ms_per_token", "mb_per_step")])
    t.notes += _stand_in_notes(matcher, models, [role])
    t.notes.append("Rows are the effective number of tidal heads (n_voice - n_anchor) recorded by the policy.")
    _marks_note(t)
    return t


# --- Table 6: 24B scaling -------------------------------------------------------------------------------
def table6(matcher: Matcher, models: list[str]) -> Table:
    t = Table("table6_scaling", "Table 6: Scaling to Voxtral-Small-24B on LibriSpeech-Long. Truncated WER (ratio 1.2).",
              ["Method", "r_GPU", "test-clean", "test-other"], n_labels=2)
    b = Builder(matcher, t)
    for model in models:
        if len(models) > 1:
            t.rows.append(f"Backbone: {model_label(model)}")
        for method in (m.name for m in table_methods(("full", "wnw", "arkvale", "adakv", "audiokv"))):
            r = None if method == "full" else 0.2
            t.rows.append([Out(label(method)), Out("100%" if r is None else "~20%")]
                          + [b.value(Cell(model, role, method, r)) for role in ("test-clean", "test-other")])
    t.notes += _stand_in_notes(matcher, models, ["test-clean", "test-other"])
    _marks_note(t)
    return t


# --- Table 7: chunk size / anchor count -----------------------------------------------------------------
def table7(matcher: Matcher, models: list[str]) -> Table:
    t = Table("table7_sensitivity", "Table 7: Hyperparameter sensitivity at ~20% GPU retention, LibriSpeech-Long "
              "test-clean. Truncated WER (ratio 1.2).", ["Chunk size", "WER", "Anchor count", "WER"], n_labels=1)
    b = Builder(matcher, t)
    role = "test-clean"
    for model in models:
        if len(models) > 1:
            t.rows.append(f"Backbone: {model_label(model)}")
        nv = n_voice_knob(model, 0.2)
        chunks = _axis(matcher, model, [0.96, 1.92, 4.0, 5.76, 7.68], role, "wnw", (0.2,), "chunk_seconds", t)
        anchors = _axis(matcher, model, [1, 3, 5, 7, 10, 15, 20], role, "wnw", (0.2,), "n_anchor", t)
        for i in range(max(len(chunks), len(anchors))):
            row = []
            if i < len(chunks):
                c = chunks[i]
                label = f"{float(c):.2f}s" + (" (default)" if same(c, 4.0) else "")
                row += [Out(label), b.value(Cell(model, role, "wnw", 0.2, nv + (("chunk_seconds", c),),
                                                 free=("stride_seconds",)), series="chunk")]
            else:
                row += [Out(""), Out("")]
            if i < len(anchors):
                a = anchors[i]
                label = f"{a}" + (" (default)" if model in PAPER_MODELS and same(a, 5) else "")
                row += [Out(label), b.value(Cell(model, role, "wnw", 0.2, nv + (("n_anchor", a),)), series="anchor")]
            else:
                row += [Out(""), Out("")]
            t.rows.append(row)
    t.notes += _stand_in_notes(matcher, models, [role])
    t.notes.append("Chunk-size cells accept any stride (the sweep sets stride = chunk / 2).")
    _marks_note(t)
    return t


# --- Table 8: calibration robustness --------------------------------------------------------------------
def _roles_overlap(a: Run | None, b: Run | None) -> str:
    """'A x/5; B y/85': anchors and tidal heads of calibration b that are also so in calibration a."""
    def roles(run):
        for _, tr in run.traces():
            if tr.get("roles") is not None:
                return np.asarray(tr["roles"])
        return None

    if a is None or b is None:
        return ""
    ra, rb = roles(a), roles(b)
    if ra is None or rb is None or ra.shape != rb.shape:
        return ""
    out = []
    for name, role in (("A", "anchor"), ("B", "tidal")):
        ref = ra == role
        out.append(f"{name} {int((ref & (rb == role)).sum())}/{int(ref.sum())}")
    return "; ".join(out)


def table8(matcher: Matcher, models: list[str]) -> Table:
    cols = [("test-clean", "clean"), ("test-other", "other"), ("asr-fr", "FR")]
    t = Table("table8_calibration", "Table 8: Cross-dataset calibration robustness (n_voice=90, n_anchor=5, target "
              "r_GPU=0.2). Truncated WER (ratio 1.2). Roles: anchors (A) and tidal heads (B) shared with the first "
              "calibration.", ["Calib."] + [c[1] for c in cols] + ["Roles"])
    b = Builder(matcher, t)
    for model in models:
        if len(models) > 1:
            t.rows.append(f"Backbone: {model_label(model)}")
        paper = model in PAPER_MODELS
        knobs = (("n_voice", 90), ("n_anchor", 5)) if paper else ()
        calibs = _axis(matcher, model, ["ls_en", "ls_fr"], "test-clean", "wnw", (0.2,), "calibration", t)
        first = None
        for i, cal in enumerate(calibs):
            cells = [Cell(model, role, "wnw", 0.2, knobs, calibration=cal) for role, _ in cols]
            row = [Out({"ls_en": "LS EN", "ls_fr": "LS FR"}.get(cal, str(cal)))] + [b.value(c) for c in cells]
            run = b.chosen.get(cells[0])
            if i == 0:
                first = run
                row.append(Out("—"))
            else:
                row.append(Out(_roles_overlap(first, run)))
            t.rows.append(row)
    t.notes += _stand_in_notes(matcher, models, [c[0] for c in cols])
    t.notes.append("Rows are the runs' `calibration` setting (conf/experiment/calibration_robustness.yaml).")
    _marks_note(t)
    return t


TABLES: dict[str, tuple[Callable[[Matcher, list[str]], Table], list[str]]] = {
    "table1": (table1, ["voxtral"]),
    "table2": (table2, ["voxtral"]),
    "table3": (table3, ["voxtral"]),
    "table4": (table4, ["voxtral"]),
    "table5": (table5, ["voxtral", "qwen_omni"]),
    "table6": (table6, ["voxtral_small"]),
    "table7": (table7, ["voxtral"]),
    "table8": (table8, ["voxtral"]),
}


def build_tables(matcher: Matcher, models: list[str] | None = None) -> list[Table]:
    """Every paper table, each followed by its paired-bootstrap intervals where it has WER cells. Backbone axis: the
    paper's backbones for that table plus every stand-in model present in the runs, or exactly `models` when given."""
    stand_ins = sorted({r.model for r in matcher.runs if r.model not in PAPER_MODELS})
    out = []
    for key in sorted(TABLES, key=lambda k: int(k[5:])):
        fn, paper = TABLES[key]
        t = fn(matcher, list(models) if models else paper + stand_ins)
        out.append(t)
        if t.compared:
            out.append(intervals(matcher, t))
    return out


# --- paired bootstrap intervals of WER differences -------------------------------------------------------
def clip_counts(run: Run) -> dict[str, tuple[str, int, int]]:
    """Sample id -> (reference, errors, reference words) of the run's scored transcription samples (failed and
    translation samples are left out), as `metrics.text.corpus_wer` counts them."""
    out = {}
    for r in run.records:
        if r.get("error") is None and r.get("task") != "translate":
            c = wer_counts(r["reference"], r["hypothesis"])
            out[r["id"]] = (r["reference"], c.errors, c.ref_words)
    return out


def paired_difference(a: dict[str, tuple[str, int, int]], b: dict[str, tuple[str, int, int]],
                      **kw: Any) -> PairedDiff | None:
    """Corpus WER of run A minus run B (their `clip_counts`) with its paired bootstrap interval, over the samples
    both scored with the same reference (paired by sample id); None when they share none with reference words."""
    shared = [i for i in a if i in b and a[i][0] == b[i][0]]
    if not shared or sum(a[i][2] for i in shared) == 0:
        return None
    return paired_bootstrap_wer([a[i][1] for i in shared], [b[i][1] for i in shared], [a[i][2] for i in shared], **kw)


def _describe(cell: Cell) -> str:
    """The method's label with the knobs (and calibration) that tell the cell from its column's other cells."""
    parts = [f"{k}={v}" for k, v in cell.knobs] + ([f"calibration={cell.calibration}"] if cell.calibration else [])
    return label(cell.method) + (f" [{', '.join(parts)}]" if parts else "")


def _signed(x: float) -> str:
    return f"{x:+.2f}"


def intervals(matcher: Matcher, t: Table) -> Table:
    """`t`'s companion table: for every WER cell, its difference to Full Cache and to the cell above it in the same
    column (the same backbone, evaluation set, r_GPU and series of rows), each with its paired bootstrap 95% interval
    (clips resampled with replacement, seed 0) and the number of clips the two runs share."""
    out = Table(f"{t.key}_ci", f"{t.title.split(':')[0]}, paired bootstrap: corpus WER difference A - B (points) and "
                "its 95% interval over the clips both runs scored.",
                ["A", "B", "A - B", "95% interval", "clips"], n_labels=2)
    columns: dict[tuple, list[tuple[Cell, Run]]] = {}
    counts: dict[int, dict] = {}  # id(run) -> its clip_counts, made once per run
    for key, cell, run in t.compared:
        columns.setdefault(key, []).append((cell, run))
    for (model, role, retention, _), cells in columns.items():
        head = f"{model_label(model)}, {role}" + ("" if retention is None else f", r_GPU={retention:g}")
        full, _ = matcher.find(Cell(model, role, "full", None))
        pairs = []
        previous = None
        for cell, run in cells:
            if cell.method == "full":
                continue
            if full is not None:
                pairs.append((cell, run, Cell(model, role, "full", None), full))
            if previous is not None:
                pairs.append((cell, run, *previous))
            previous = (cell, run)
        if not pairs:
            continue
        out.rows.append(head)
        for cell_a, run_a, cell_b, run_b in pairs:
            for run in (run_a, run_b):
                if id(run) not in counts:
                    counts[id(run)] = clip_counts(run)
            d = paired_difference(counts[id(run_a)], counts[id(run_b)])
            out.n_cells += 1  # a comparison is a cell: missing when the two runs share no clip
            if d is None:
                out.missing.append(f"{head}: {_describe(cell_a)} - {_describe(cell_b)}: the runs share no scored clip")
                out.rows.append([Out(_describe(cell_a)), Out(_describe(cell_b)), Out(""), Out("no shared clips"),
                                 Out("0")])
                continue
            mark = "*" if d.excludes_zero else ""
            out.rows.append([Out(_describe(cell_a)), Out(_describe(cell_b)), Out(_signed(d.diff) + mark),
                             Out(f"[{_signed(d.low)}, {_signed(d.high)}]"), Out(str(d.n_clips))])
    out.notes.append("Each row compares a cell of the table with Full Cache on the same evaluation set, and with the "
                     "cell above it in its column (its neighbouring method or setting). Clips are paired by sample "
                     "id: only those both runs scored, with the same reference, count. The statistic is the corpus "
                     "truncated WER of A minus B on a resample of those clips (10,000 resamples with replacement, "
                     "seed 0); the interval is its 2.5-97.5 percentile range. *: the interval excludes 0. BLEU "
                     "cells have no interval here.")
    return out


# --- rendering ------------------------------------------------------------------------------------------
def _md_escape(s: str) -> str:
    return s.replace("|", "\\|")


def to_markdown(t: Table) -> str:
    n = len(t.columns)
    lines = [f"### {t.title}", ""]
    header = list(t.columns)
    if t.groups:
        header, i = [], 0
        for text, span in t.groups:
            for j in range(span):
                col = t.columns[i + j]
                header.append(f"{text.replace(' (WER)', '')} {col.split(' ')[-1]}".strip() if text else col)
            i += span
    lines.append("| " + " | ".join(_md_escape(h) for h in header) + " |")
    lines.append("|" + "|".join([":---"] * t.n_labels + ["---:"] * (n - t.n_labels)) + "|")
    for row in t.rows:
        if isinstance(row, str):
            parts = [p.strip() for p in row.split("|")]
            cells = [f"**{_md_escape(parts[0])}**"] + [f"*{_md_escape(p)}*" if p else "" for p in parts[1:]]
            cells += [""] * (n - len(cells))
            lines.append("| " + " | ".join(cells) + " |")
            continue
        cells = []
        for o in row:  # Markdown cannot span columns: a spanning value is repeated in each column it spans
            cells += [_md_escape(o.text)] * o.span
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"{t.n_filled} of {t.n_cells} cells have a run; {len(t.missing)} missing (see missing.md).")
    for note in t.notes:
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"$\sim$", "^": r"\^{}", "†": r"$^\dagger$", "‡": r"$^\ddagger$",
                  "—": "---", "≈": r"$\approx$"}


def latex_escape(s: str) -> str:
    out = "".join(_LATEX_SPECIAL.get(ch, ch) for ch in s)
    return out.replace("r\\_GPU+CPU", r"$r_{\text{GPU+CPU}}$").replace("r\\_GPU", r"$r_{\text{GPU}}$")


def to_latex(t: Table) -> str:
    n = len(t.columns)
    align = "l" * t.n_labels + "r" * (n - t.n_labels)
    lines = [r"\begin{table}[t]", r"\centering", r"\small",
             rf"\caption{{{latex_escape(re.sub(r'^Table [0-9]+: ', '', t.title))}}}", rf"\label{{tab:{t.key}}}",
             rf"\begin{{tabular}}{{{align}}}", r"\toprule"]
    if t.groups:
        cells, rules, col = [], [], 1
        for text, span in t.groups:
            cells.append(rf"\multicolumn{{{span}}}{{c}}{{{latex_escape(text)}}}" if span > 1 else latex_escape(text))
            if text and span > 1:
                rules.append(rf"\cmidrule(lr){{{col}-{col + span - 1}}}")
            col += span
        lines.append(" & ".join(cells) + r" \\")
        lines.append("".join(rules))
        cols = [t.columns[0]] + [c.split(" ")[-1] for c in t.columns[1:]]
    else:
        cols = t.columns
    lines.append(" & ".join(latex_escape(c) for c in cols) + r" \\")
    lines.append(r"\midrule")
    for row in t.rows:
        if isinstance(row, str):
            parts = [p.strip() for p in row.split("|")]
            if len(parts) == 1:
                lines.append(rf"\multicolumn{{{n}}}{{l}}{{\textit{{{latex_escape(parts[0])}}}}} \\")
            else:
                cells = [rf"\textit{{{latex_escape(p)}}}" if p else "" for p in parts] + [""] * (n - len(parts))
                lines.append(" & ".join(cells) + r" \\")
            continue
        cells = []
        for o in row:
            text = latex_escape(o.text)
            cells.append(rf"\multicolumn{{{o.span}}}{{c}}{{{text}}}" if o.span > 1 else text)
        lines.append(" & ".join(cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines) + "\n"
