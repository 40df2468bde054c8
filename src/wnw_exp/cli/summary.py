"""What `wnw-run` prints: one row per run, alone after a run, all together at the end of a `-m` sweep.

Columns: model, data set (name-split), method, target (the `retention` asked for), n (samples the run's
configuration selects), fail (of them, failed), WER% (corpus truncated WER, §3.5), BLEU (translation only),
r_gpu and r_g+c (measured r_GPU and r_GPU+CPU of §3.4, mean over samples of the mean over decode steps), ms/tok
(median decode-step wall time), term (share of samples that stopped at EOS rather than at the length cap).
"""

from __future__ import annotations

from pathlib import Path

# (header, key, format, align)
COLUMNS = (("model", "model", "s", "<"), ("dataset", "dataset", "s", "<"), ("method", "method", "s", "<"),
           ("target", "retention", "", ">"), ("n", "n_samples", "d", ">"), ("fail", "n_failed", "d", ">"),
           ("WER%", "wer", ".2f", ">"), ("BLEU", "bleu", ".2f", ">"), ("r_gpu", "r_gpu", ".3f", ">"),
           ("r_g+c", "r_gpu_cpu", ".3f", ">"), ("ms/tok", "ms_per_token", ".2f", ">"),
           ("term", "terminated_rate", ".2f", ">"))


def result_row(cfg: dict, metrics: dict, run_dir: Path) -> dict:
    """The run's row: what the table shows and where the run is (what a sweep's job returns)."""
    return dict(model=cfg["model"]["name"], dataset=f"{cfg['dataset']['name']}-{cfg['dataset'].get('split')}",
                method=cfg["method"]["name"], retention=cfg["retention"], run_dir=str(run_dir),
                **{k: metrics.get(k) for _, k, _, _ in COLUMNS[4:]})


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict], extra: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """The header and one line per row, columns as wide as their widest cell; `extra` = (header, key) of more
    columns, left-aligned, the last one not padded."""
    cols = COLUMNS + tuple((h, k, "s", "<") for h, k in extra)
    cells = [[h for h, _, _, _ in cols]] + [[_cell(r.get(k), f) for _, k, f, _ in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return [" ".join(format(c, f"{a}{w}") for c, w, (_, _, _, a) in zip(line, widths, cols)).rstrip()
            for line in cells]


def run_summary(row: dict) -> str:
    return "\n".join(table([row]) + [f"run directory: {row['run_dir']}"])


def job_line(row: dict, index: int, total: int | None, seconds: float) -> str:
    """A sweep job's one line when it ends: `[k/N] model dataset method r=... [swept]: n samples, WER ... (s)`."""
    def f(key: str, fmt: str) -> str:
        return _cell(row.get(key), fmt)

    where = f"[{index}/{total}]" if total else f"[job {index}]"
    swept = f" {row['swept']}" if row.get("swept") else ""
    failed = f", {row['n_failed']} failed" if row.get("n_failed") else ""
    return (f"{where} {row['model']} {row['dataset']} {row['method']} r={row['retention']}{swept}: "
            f"{row['n_samples']} samples{failed}, WER {f('wer', '.2f')}%, r_gpu {f('r_gpu', '.3f')} ({seconds:.0f} s)")


def sweep_summary(rows: list[dict], root: str | None = None) -> str:
    """The table of a sweep: a row per job, the values of the swept keys the other columns do not show (when
    any), its run directory (under `root`, when given) last."""
    shown = []
    for r in rows:
        d = Path(r.get("run_dir", ""))
        if root and d.is_relative_to(Path(root).resolve()):
            d = d.relative_to(Path(root).resolve())
        shown.append(dict(r, where=str(d)))
    extra = ((("swept", "swept"),) if any(r.get("swept") for r in rows) else ()) + (("run directory", "where"),)
    head = f"{len(rows)} runs" + (f", run directories under {root}/" if root else "") + ":"
    return "\n".join([head] + table(shown, extra=extra))


def swept_values(overrides: list[str], axes: list[str]) -> str:
    """`k=v,...` of this job's overrides for the sweep's `axes` (keys the job's row does not already show)."""
    mine = dict(o.lstrip("+~").split("=", 1) for o in overrides if "=" in o)
    return ",".join(f"{k}={mine[k]}" for k in axes if k in mine)
