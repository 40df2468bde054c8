"""The whole report: runs -> runs.csv, every table (Markdown + LaTeX), Figures 1/3/4, missing.md, report.md.

Output layout (`out`):
  runs.csv                one row per run (shards merged)
  tables/<table>.md|.tex  Tables 1-8 and the §2.1 mismatch numbers
  figures/*.png|.pdf      Figure 1 per model with an analysis run, Figure 3, Figure 4 per model
  mismatch.json           the averaged §2.1 statistics, grids and per-head Jaccard
  missing.md              every blank cell, by table
  report.md               all tables, figure links and the missing count, in one page
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from wnw_exp.paths import conf_dir
from wnw_exp.report import figures, tables
from wnw_exp.report.collect import Run, collect_runs, to_frame
from wnw_exp.report.mismatch import analysis_runs, mismatch_table, summarise
from wnw_exp.report.specs import PAPER_MODELS, Data, Matcher, method_defaults

DEFAULT_CONF = conf_dir()  # the method defaults of the conf/ inside the package, or $WNW_CONF


@dataclass
class ReportResult:
    runs: list[Run]
    tables: list[tables.Table]
    figures: list[Path] = field(default_factory=list)
    out: Path | None = None

    @property
    def missing(self) -> int:
        return sum(len(t.missing) for t in self.tables)


def _figure_models(runs: list[Run], models: list[str] | None) -> list[str]:
    present = {r.model for r in runs}
    if models:
        return [m for m in models if m in present]
    return [m for m in PAPER_MODELS if m in present] + sorted(present - set(PAPER_MODELS))


def build_report(roots: list[Path | str], out: Path | str, *, conf_dir: Path | None = DEFAULT_CONF,
                 models: list[str] | None = None, stand_in: dict[str, Data] | None = None,
                 figure4_sample: str | None = None, make_figures: bool = True) -> ReportResult:
    out = Path(out)
    _clear(out)
    (out / "tables").mkdir(parents=True, exist_ok=True)
    runs = collect_runs([Path(r) for r in roots])
    to_frame(runs).to_csv(out / "runs.csv", index=False)
    matcher = Matcher(runs, method_defaults(conf_dir), stand_in)

    built = tables.build_tables(matcher, models)
    summaries = [s for s in (summarise(r) for r in analysis_runs(runs)) if s is not None]
    built.append(mismatch_table(summaries))
    for t in built:
        (out / "tables" / f"{t.key}.md").write_text(tables.to_markdown(t))
        (out / "tables" / f"{t.key}.tex").write_text(tables.to_latex(t))
    (out / "mismatch.json").write_text(json.dumps([s.as_dict() for s in summaries], indent=1) + "\n")

    result = ReportResult(runs, built, out=out)
    if make_figures:
        fig_dir = out / "figures"
        fmodels = _figure_models(runs, models)
        for model in fmodels:  # Figure 1: the model's analysis run, Full Cache preferred
            mine = sorted((s for s in summaries if s.run.model == model),
                          key=lambda s: (s.run.method != "full", s.run.split != "dev-clean", -s.n_samples))
            if mine:
                result.figures += figures.figure1(mine[0], fig_dir, f"figure1_mismatch_{model}")
        result.figures += figures.figure3(matcher, fmodels, fig_dir)
        for model in fmodels:
            result.figures += figures.figure4(matcher, model, fig_dir, f"figure4_gpu_kv_{model}",
                                              sample_id=figure4_sample)
    _write_missing(out, built)
    _write_index(out, result)
    return result


def _clear(out: Path) -> None:
    """Remove what an earlier report wrote, so that a figure or table nothing supports any more is gone."""
    for pattern in ("runs.csv", "mismatch.json", "missing.md", "report.md", "tables/*.md", "tables/*.tex",
                    "figures/figure*.png", "figures/figure*.pdf"):
        for p in out.glob(pattern):
            p.unlink()


def _write_missing(out: Path, built: list[tables.Table]) -> None:
    lines = ["# Missing cells", "", "A blank cell in a table is a cell no run directory provides. Nothing is "
             "filled in; run the experiment that provides it (conf/experiment/) and re-run `wnw-report`.", ""]
    for t in built:
        lines.append(f"## {t.title.split(':')[0]} ({len(t.missing)} of {t.n_cells} missing)")
        lines += [f"- {m}" for m in t.missing] or ["- none"]
        lines.append("")
    (out / "missing.md").write_text("\n".join(lines))


def _write_index(out: Path, result: ReportResult) -> None:
    lines = ["# wnw-exp report", "", f"{len(result.runs)} runs collected (runs.csv); "
             f"{result.missing} table cells missing (missing.md).", ""]
    figs = sorted({p.relative_to(out) for p in result.figures if p.suffix == ".png"})
    if figs:
        lines += ["## Figures", ""] + [f"![{p.stem}]({p.as_posix()})" for p in figs] + [""]
    lines += ["## Tables", ""]
    for t in result.tables:
        lines.append(tables.to_markdown(t))
    (out / "report.md").write_text("\n".join(lines))
