"""Run directories -> one `Run` per configuration -> one pandas DataFrame row per run.

Reads only what a run leaves on disk (the contract of DESIGN.md): `.hydra/config.yaml` (the resolved
config), `.hydra/overrides.yaml` and `.hydra/hydra.yaml` (the override dirname and the experiment
chosen), `predictions.jsonl`, `metrics.json` and `trace/<id>.json`. It never imports torch or a model.

A run directory counts the samples its metrics.json lists (`sample_ids`: those its last run selected),
like the runner; predictions of other samples in the file are left out. Run directories of one identity
(`rundir.identity_hash`) and one `dataset.num_shards` are one run: data-parallel shards
(`dataset.shard=i dataset.num_shards=n`) are merged, with metrics recomputed from the union of their
predictions with the runner's own `aggregate`.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pandas as pd
import yaml
from omegaconf import OmegaConf

from wnw_exp.rundir import METRICS, PREDICTIONS, aggregate, identity_hash, read_predictions

SHARD_KEY = "dataset.shard"

CORE_COLUMNS = ["model", "dataset", "split", "language", "task", "method", "retention", "analysis", "calibration",
                "seed", "dtype", "overrides", "experiment", "num_shards", "shards", "complete", "run_dir"]
METRIC_COLUMNS = ["wer", "bleu", "r_gpu", "r_gpu_cpu", "r_gpu_end", "r_gpu_cpu_end", "ms_per_token", "mb_per_step",
                  "terminated_rate", "n_samples", "n_failed", "ref_words"]


@dataclass
class Run:
    """One configuration's results: a run directory, or the merged shards of one."""

    run_dirs: list[Path]
    config: dict  # resolved .hydra/config.yaml (of the first shard)
    overrides: dict[str, str]  # override dirname items, `dataset.shard` removed
    experiment: str | None
    records: list[dict]
    metrics: dict
    shards: list[int] = field(default_factory=lambda: [0])
    num_shards: int = 1
    n_selected: int | None = None  # samples the configuration selects (None: not recorded)

    # --- identity -------------------------------------------------------------------------------
    @property
    def model(self) -> str:
        return str(self.config.get("model", {}).get("name"))

    @property
    def dataset(self) -> str:
        return str(self.config.get("dataset", {}).get("name"))

    @property
    def split(self) -> str | None:
        s = self.config.get("dataset", {}).get("split")
        return None if s is None else str(s)

    @property
    def language(self) -> str | None:
        return self.config.get("dataset", {}).get("language")

    @property
    def method(self) -> str:
        return str(self.config.get("method", {}).get("name"))

    @property
    def retention(self) -> float | None:
        r = self.config.get("retention")
        return float(r) if isinstance(r, (int, float)) else None

    @property
    def analysis(self) -> str | None:
        return self.config.get("analysis")

    @property
    def calibration(self) -> str | None:
        c = self.config.get("calibration")
        return None if c is None else str(c)

    @property
    def task(self) -> str | None:
        tasks = Counter(r.get("task") for r in self.records if r.get("task"))
        return tasks.most_common(1)[0][0] if tasks else None

    @property
    def complete(self) -> bool:
        """Every shard is here and so is every sample the configuration selects (an interrupted run is not)."""
        all_shards = sorted(self.shards) == list(range(self.num_shards))
        return all_shards and (self.n_selected is None or len(self.records) >= self.n_selected)

    @property
    def method_config(self) -> dict:
        return {k: v for k, v in self.config.get("method", {}).items() if k != "name"}

    @property
    def policy_knobs(self) -> dict:
        """The policy's per-sample `knobs` (e.g. the solved λ): one value when all samples agree, the mean of
        numbers otherwise, None when they disagree otherwise."""
        per_key: dict[str, list] = {}
        for r in self.records:
            if r.get("error") is None:
                for k, v in (r.get("knobs") or {}).items():
                    per_key.setdefault(k, []).append(v)
        out = {}
        for k, vs in per_key.items():
            if all(v == vs[0] for v in vs):
                out[k] = vs[0]
            elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vs):
                out[k] = sum(vs) / len(vs)
            else:
                out[k] = None
        return out

    def knob(self, name: str) -> Any:
        """A method knob's effective value: the config's, or the policy's record where the config says
        `auto`/null (WnW's n_voice, n_anchor and λ are chosen per retention or per sample)."""
        cfg = self.method_config
        if name in cfg and cfg[name] not in (None, "auto"):
            return cfg[name]
        return self.policy_knobs.get(name, cfg.get(name))

    @property
    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in sorted(self.overrides.items()))
        ret = "" if self.retention is None else f" r={self.retention:g}"
        return f"{self.model}/{self.dataset}-{self.split}/{self.method}{ret}" + (f" [{extra}]" if extra else "")

    # --- traces ---------------------------------------------------------------------------------
    def trace_ids(self) -> list[str]:
        return [r["id"] for r in self.records if r.get("error") is None]

    def trace(self, sample_id: str) -> dict | None:
        for d in self.run_dirs:
            path = d / "trace" / f"{sample_id}.json"
            if path.exists():
                try:
                    return json.loads(path.read_text())
                except ValueError:
                    return None
        return None

    def traces(self) -> Iterator[tuple[str, dict]]:
        for sid in self.trace_ids():
            t = self.trace(sid)
            if t is not None:
                yield sid, t

    # --- the DataFrame row ----------------------------------------------------------------------
    def row(self) -> dict:
        m = self.metrics
        row = dict(model=self.model, dataset=self.dataset, split=self.split, language=self.language,
                   task=self.task, method=self.method, retention=self.retention, analysis=self.analysis,
                   calibration=self.calibration, seed=self.config.get("seed"), dtype=self.config.get("dtype"),
                   overrides=",".join(f"{k}={v}" for k, v in sorted(self.overrides.items())),
                   experiment=self.experiment, num_shards=self.num_shards,
                   shards=",".join(map(str, sorted(self.shards))), complete=self.complete,
                   run_dir=";".join(str(d) for d in self.run_dirs))
        for k in METRIC_COLUMNS:
            row[k] = m.get(k)
        if row["ref_words"] is None:
            row["ref_words"] = (m.get("wer_counts") or {}).get("ref_words")
        for k in sorted(set(self.method_config) | set(self.policy_knobs)):
            v = self.knob(k)
            if isinstance(v, (list, dict)):
                v = json.dumps(v)
            row[k if k not in row else f"method.{k}"] = v
        return row


# --- reading ---------------------------------------------------------------------------------------
def find_run_dirs(root: Path) -> list[Path]:
    """Every directory below `root` (itself included) holding `.hydra/config.yaml`; run directories nest
    (a run's override dirname is a sub-folder of the default run's folder)."""
    found = []
    for dirpath, dirnames, _ in os.walk(root):
        if (Path(dirpath) / ".hydra" / "config.yaml").is_file():
            found.append(Path(dirpath))
        dirnames[:] = sorted(d for d in dirnames if d not in (".hydra", "trace", ".submitit"))
    return sorted(found)


def _load_config(path: Path) -> dict:
    cfg = OmegaConf.load(path)
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - an interpolation this process cannot resolve: keep it as written
        return OmegaConf.to_container(cfg, resolve=False)


def _yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text()) if path.exists() else None
    except yaml.YAMLError:
        return None


def _override_items(run_dir: Path) -> tuple[dict[str, str], str | None]:
    """(override dirname items as key -> value, the experiment chosen) from Hydra's records."""
    hydra = (_yaml(run_dir / ".hydra" / "hydra.yaml") or {}).get("hydra", {})
    excluded = set(((hydra.get("job") or {}).get("config") or {}).get("override_dirname", {}).get("exclude_keys")
                   or [])
    experiment = ((hydra.get("runtime") or {}).get("choices") or {}).get("experiment")
    overrides = _yaml(run_dir / ".hydra" / "overrides.yaml") or []
    items = {}
    for line in overrides:
        key, _, value = str(line).lstrip("+~").partition("=")
        if key not in excluded:
            items[key] = value
    return items, experiment


def _dig(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def read_run_dir(run_dir: Path) -> dict:
    config = _load_config(run_dir / ".hydra" / "config.yaml")
    overrides, experiment = _override_items(run_dir)
    records = read_predictions(run_dir)
    metrics = None
    if (run_dir / METRICS).exists():
        try:
            metrics = json.loads((run_dir / METRICS).read_text())
        except ValueError:
            metrics = None
    if metrics is not None and "sample_ids" in metrics:  # the samples the last run selected, in its order
        by_id = {r["id"]: r for r in records}
        records = [by_id[i] for i in metrics["sample_ids"] if i in by_id]
    return dict(dir=run_dir, config=config, overrides=overrides, experiment=experiment, records=records,
                metrics=metrics)


def collect_runs(roots: list[Path | str]) -> list[Run]:
    """Every run below `roots`, shards of one configuration merged, in a stable order."""
    groups: dict[str, list[dict]] = {}
    for root in roots:
        root = Path(root)
        if not root.exists():
            continue
        for d in find_run_dirs(root):
            if not (d / PREDICTIONS).exists() and not (d / METRICS).exists():
                continue  # started, nothing finished yet
            info = read_run_dir(d)
            key = (identity_hash(info["config"]), _dig(info["config"], "dataset.num_shards") or 1)
            groups.setdefault(key, []).append(info)
    runs = [_merge(parts) for parts in groups.values()]
    runs.sort(key=lambda r: (r.model, r.dataset, str(r.split), r.method, r.retention or 0.0, r.label))
    return runs


def _merge(parts: list[dict]) -> Run:
    parts = sorted(parts, key=lambda p: (_dig(p["config"], SHARD_KEY) or 0, str(p["dir"])))
    first = parts[0]
    by_id: dict[str, dict] = {}
    for p in parts:
        for r in p["records"]:
            by_id[r["id"]] = r
    records = list(by_id.values())
    if records:
        metrics = aggregate(records)
    else:
        metrics = first["metrics"] or {}
    overrides = {k: v for k, v in first["overrides"].items() if k != SHARD_KEY}
    num_shards = int(_dig(first["config"], "dataset.num_shards") or 1)
    shards = sorted({int(_dig(p["config"], SHARD_KEY) or 0) for p in parts})
    n_selected = _n_selected(parts, num_shards)
    if records and n_selected is not None:
        metrics["n_selected"] = n_selected  # as metrics.json has it (summed over the shards)
    return Run(run_dirs=[p["dir"] for p in parts], config=first["config"], overrides=overrides,
               experiment=first["experiment"], records=records, metrics=metrics, shards=shards,
               num_shards=num_shards, n_selected=n_selected)


def _n_selected(parts: list[dict], num_shards: int) -> int | None:
    """How many samples the configuration selects: metrics.json's `n_selected`, summed over the shards (two
    directories of one shard, e.g. the same configuration under two override spellings, count once, the larger);
    for a run written before it was recorded, `dataset.n` of an unsharded run (a data set smaller than n then
    reads as incomplete, which it is against what was asked); None when neither says."""
    per_shard: dict[int, int] = {}
    for p in parts:
        n = (p["metrics"] or {}).get("n_selected")
        if not isinstance(n, int):
            break
        shard = int(_dig(p["config"], SHARD_KEY) or 0)
        per_shard[shard] = max(per_shard.get(shard, 0), n)
    else:
        return sum(per_shard.values())
    n = _dig(parts[0]["config"], "dataset.n")
    return n if num_shards == 1 and isinstance(n, int) and not isinstance(n, bool) else None


def to_frame(runs: list[Run]) -> pd.DataFrame:
    """One row per run: identity, measured metrics, then every method knob (effective values)."""
    rows = [r.row() for r in runs]
    knob_cols = sorted({k for row in rows for k in row} - set(CORE_COLUMNS) - set(METRIC_COLUMNS))
    frame = pd.DataFrame(rows, columns=CORE_COLUMNS + METRIC_COLUMNS + knob_cols)
    return frame


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not (isinstance(x, float) and math.isnan(x))
