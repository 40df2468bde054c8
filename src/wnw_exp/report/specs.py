"""Which run fills which table cell: the paper's tables written as data.

A cell names a backbone, an evaluation set (a *role*: "test-clean", "asr-fr", ...), a method, a target
retention, and the method knobs it needs. `find_run` picks the run that matches; a cell no run matches
stays blank and is listed as missing. Nothing is ever computed for a cell that has no run.

Matching rule (`find_run`):
- model, data set (name, split, language when the role fixes them), method, target retention (Full
  Cache: any retention, 1.0 preferred — `full` ignores it), `calibration` (Table 8 only), no analysis;
- every knob the cell names must have that *effective* value (the config's, or the policy's record
  where the config says `auto`, e.g. WnW's n_voice);
- every other method knob must be at its default in `conf/method/<method>.yaml` (so an ablation run
  never fills a main-table cell), except the knobs the cell lets vary and `head_scores` (which file a
  method reads is a deployment detail; Table 8 tells calibrations apart by `calibration`);
- among several matches: the fewest other overrides, then the most finished samples, then the path;
  the choice is noted.

Stand-ins: a model that is not one of the paper's backbones (e.g. `whisper_smollm2`) gets its own block or row in
every table, and its data roles map to stand-in data sets (default: test-clean -> synthetic/test).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from wnw_exp.report.collect import Run

PAPER_MODELS = {"voxtral": "Voxtral-mini-3b", "qwen_omni": "Qwen2.5-Omni-3B", "voxtral_small": "Voxtral-Small-24B"}
ALWAYS_FREE = ("head_scores",)
MAIN_RETENTIONS = (0.8, 0.6, 0.4, 0.2)
# §3.4: WnW's n_voice per target on the paper's backbones (also the method's `auto` default).
PAPER_N_VOICE = {"voxtral": {0.2: 90, 0.4: 50, 0.6: 30, 0.8: 30}, "qwen_omni": {0.2: 27, 0.4: 15, 0.6: 9, 0.8: 9},
                 "voxtral_small": {}}


@dataclass(frozen=True)
class Data:
    """An evaluation set as the runs name it; `split`/`language` None match any."""

    dataset: str
    split: str | None = None
    language: str | None = None

    def __str__(self) -> str:
        return "/".join(x for x in (self.dataset, self.split, self.language) if x)

    @staticmethod
    def parse(text: str) -> "Data":
        parts = text.split("/")
        if not 1 <= len(parts) <= 3 or not parts[0]:
            raise ValueError(f"data set {text!r}: expected DATASET[/SPLIT[/LANGUAGE]]")
        return Data(*[p or None for p in parts])


# The paper's evaluation sets, by role.
ROLES = {
    "test-clean": Data("librispeech_long", "test-clean"),
    "test-other": Data("librispeech_long", "test-other"),
    "dev-clean": Data("librispeech_long", "dev-clean"),
    "asr-fr": Data("longspeech_asr_fr"),
    "en2fr": Data("longspeech_en2fr"),
    "primock57": Data("primock57"),
}
DEFAULT_STAND_IN = {"test-clean": Data("synthetic", "test", "en"), "dev-clean": Data("synthetic", "dev", "en")}


@dataclass(frozen=True)
class Cell:
    model: str
    role: str
    method: str
    retention: float | None  # None: Full Cache, any retention
    knobs: tuple[tuple[str, Any], ...] = ()  # effective values the run must have
    free: tuple[str, ...] = ()  # knobs allowed to differ from their defaults
    calibration: str | None = None
    value: str = "wer"  # metric shown

    def describe(self) -> str:
        parts = [self.model, self.role, self.method]
        if self.retention is not None:
            parts.append(f"r={self.retention:g}")
        parts += [f"{k}={v}" for k, v in self.knobs]
        if self.calibration:
            parts.append(f"calibration={self.calibration}")
        return " ".join(parts)


def method_defaults(conf_dir: Path | None) -> dict[str, dict]:
    """`conf/method/<name>.yaml` as dicts (knob defaults), by method name; {} when there is no conf dir."""
    out: dict[str, dict] = {}
    if conf_dir is None or not (Path(conf_dir) / "method").is_dir():
        return out
    for path in sorted((Path(conf_dir) / "method").glob("*.yaml")):
        try:
            d = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError:
            continue
        if isinstance(d, dict):
            out[str(d.get("name", path.stem))] = {k: v for k, v in d.items() if k not in ("name", "defaults")}
    return out


def same(a: Any, b: Any) -> bool:
    """Knob equality: numbers within 1e-6 (0.96 s from YAML vs from a float), auto == null, else ==."""
    if a in (None, "auto") and b in (None, "auto"):
        return True
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(a, str) and isinstance(b, (int, float)) or isinstance(b, str) and isinstance(a, (int, float)):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)
        except ValueError:
            return False
    return a == b


class Matcher:
    """Finds the run for a cell (see the module docstring)."""

    def __init__(self, runs: list[Run], defaults: dict[str, dict], stand_in: dict[str, Data] | None = None):
        self.runs = runs
        self.defaults = defaults
        self.stand_in = dict(DEFAULT_STAND_IN if stand_in is None else stand_in)

    def data_for(self, model: str, role: str) -> Data | None:
        if model in PAPER_MODELS:
            return ROLES[role]
        return self.stand_in.get(role)

    def base(self, model: str, role: str, method: str) -> list[Run]:
        """Runs of a model / data role / method, analyses excluded."""
        data = self.data_for(model, role)
        if data is None:
            return []
        out = []
        for r in self.runs:
            if r.model != model or r.method != method or r.analysis is not None or r.dataset != data.dataset:
                continue
            if data.split is not None and r.split != data.split:
                continue
            if data.language is not None and r.language is not None and r.language != data.language:
                continue
            out.append(r)
        return out

    def candidates(self, cell: Cell) -> list[Run]:
        out = []
        for r in self.base(cell.model, cell.role, cell.method):
            if cell.retention is not None and (r.retention is None or not same(r.retention, cell.retention)):
                continue
            if r.calibration != cell.calibration:
                continue
            if not all(same(r.knob(k), v) for k, v in cell.knobs):
                continue
            if not self._others_default(r, cell):
                continue
            out.append(r)
        return out

    def _others_default(self, run: Run, cell: Cell) -> bool:
        named = {k for k, _ in cell.knobs} | set(cell.free) | set(ALWAYS_FREE)
        defaults = self.defaults.get(run.method)
        for k, v in run.method_config.items():
            if k in named:
                continue
            if defaults is None or k not in defaults:
                if f"method.{k}" in run.overrides:  # no default known: an explicit override departs from it
                    return False
            elif not same(v, defaults[k]):
                return False
        return True

    def find(self, cell: Cell) -> tuple[Run | None, int]:
        """The chosen run (or None) and how many runs matched."""
        cands = self.candidates(cell)
        if not cands:
            return None, 0

        def rank(r: Run):
            other = sum(1 for k in r.overrides if not k.startswith("method."))
            full_pref = 0 if (cell.retention is not None or same(r.retention, 1.0)) else 1
            done = r.metrics.get("n_samples", 0) - r.metrics.get("n_failed", 0)
            return (other, full_pref, -(r.retention or 0.0) if cell.retention is None else 0.0, -done, r.label)

        cands.sort(key=rank)
        return cands[0], len(cands)

    def present_values(self, model: str, role: str, method: str, retentions: tuple[float, ...], knob: str,
                       exclude_none: bool = True) -> list:
        """Distinct effective values of `knob` among a model's runs (the axis of a stand-in's sweep table)."""
        vals = []
        for r in self.base(model, role, method):
            if r.retention is None or not any(same(r.retention, x) for x in retentions):
                continue
            v = r.knob(knob) if knob != "calibration" else r.calibration
            if (v is None and exclude_none) or any(same(v, u) for u in vals):
                continue
            vals.append(v)
        try:
            return sorted(vals)
        except TypeError:
            return sorted(vals, key=str)
