"""The jobs of a `wnw-run -m` sweep: a method that keeps every audio position runs once, whatever the retentions
swept.

`retention` means nothing to a method whose policy class says `uses_retention = False` (Full Cache): each of its
jobs is run at retention=1.0, and jobs that are then the same run once (`-m method=full,adakv retention=0.2,0.4` is
three runs, not four). Used by the sweeper (src/hydra_plugins/wnw_sweeper) before any job is launched; a single
`wnw-run method=full` gets the same through `RetentionFreeRunsAtOne` (cli/run.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

SWEEP_SIZE_ENV = "WNW_SWEEP_JOBS"  # the sweep's job count, for each job's `[k/N]` line
SWEEP_AXES_ENV = "WNW_SWEEP_AXES"  # the keys the jobs differ in that a row does not show (comma-separated)
SHOWN = ("model", "dataset", "method", "retention", "dataset.split")  # keys a job's row shows anyway


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def ignores_retention(method: str | None) -> bool:
    """Whether the policy class of `method` says `uses_retention = False` (it keeps every audio position)."""
    from wnw_exp.methods import registered_methods  # torch: a sweep's jobs import it anyway

    cls = registered_methods().get(method) if method is not None else None
    return cls is not None and not cls.uses_retention


def retention_free_runs_once(jobs: Sequence[Sequence[str]], composed: Callable[[list[str]], tuple[str, float]]
                             ) -> tuple[list[list[str]], list[str]]:
    """(the jobs to launch, what was changed): every job whose composed config (`composed(job)` -> method name,
    retention) is of a method that ignores the retention (`ignores_retention`) at a retention other than 1 is set
    to retention=1.0, then repeated jobs are dropped, the first of each kept in order."""
    out, seen, moved = [], set(), {}
    for job in jobs:
        job = list(job)
        method, retention = composed(job)
        if retention != 1.0 and ignores_retention(method):
            moved.setdefault(method, []).append(retention)
            job = [o for o in job if _key(o) != "retention"] + ["retention=1.0"]
        key = tuple(sorted(job))
        if key not in seen:
            seen.add(key)
            out.append(job)
    notes = []
    dropped = len(jobs) - len(out)
    for method, retentions in moved.items():
        rs = ", ".join(f"{r:g}" for r in sorted(set(retentions)))
        notes.append(f"method={method} keeps every audio position: its jobs at retention {rs} run at retention=1.0")
    if notes and dropped:
        notes[-1] += f" ({dropped} repeated job{'s' if dropped > 1 else ''} left out)"
    return out, notes


def sweep_axes(jobs: Sequence[Sequence[str]]) -> list[str]:
    """The keys whose value differs between jobs, other than those a row shows, in first-seen order."""
    values: dict[str, set] = {}
    for job in jobs:
        for o in job:
            if "=" in o:
                values.setdefault(_key(o), set()).add(o.split("=", 1)[1])
    return [k for k, v in values.items() if len(v) > 1 and k not in SHOWN]
