"""`head_scores.json`: what `wnw-calibrate` writes and what WnW and AudioKV read.

One JSON object:
  format            "wnw-head-scores/1"
  model             the model name (`model.name`, e.g. "voxtral"), and its head layout:
  n_layers, n_q_heads, n_kv_heads, head_dim, token_rate
  voice_score       [layer][kv head]  Eq. (3), averaged over answer tokens and samples, then over the GQA group
  head_sensitivity  [layer][kv head]  Eqs. (4)-(5)
  voice_score_q     [layer][query head]  the per-query-head hit ratio before the GQA average (diagnostics)
  calibration       dataset config, n_samples, tokens counted, alignment config, k_top, hs_tokens, ...
  code_version      {"wnw_exp": version, "git_commit": commit or null}
  created           ISO time

A run finds its file through `method.head_scores`: a path, or null for the file shipped for the model
(`wnw_exp/calibration/shipped/<model>.json`). A file made for another model or head layout is refused.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from wnw_exp.paths import shipped_head_scores

FORMAT = "wnw-head-scores/1"
LAYOUT_KEYS = ("n_layers", "n_q_heads", "n_kv_heads")


class HeadScoresError(ValueError):
    """A missing, malformed or mismatched head-score file."""


@dataclass
class HeadScores:
    model: str
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    token_rate: float
    voice_score: np.ndarray  # (L, H_kv)
    head_sensitivity: np.ndarray  # (L, H_kv)
    voice_score_q: np.ndarray | None = None  # (L, H_q)
    calibration: dict = field(default_factory=dict)
    code_version: dict = field(default_factory=dict)
    created: str | None = None
    path: str | None = None  # where it was read from

    def to_json(self) -> dict:
        return dict(
            format=FORMAT, model=self.model, n_layers=self.n_layers, n_q_heads=self.n_q_heads,
            n_kv_heads=self.n_kv_heads, head_dim=self.head_dim, token_rate=self.token_rate,
            voice_score=np.asarray(self.voice_score).tolist(),
            head_sensitivity=np.asarray(self.head_sensitivity).tolist(),
            voice_score_q=None if self.voice_score_q is None else np.asarray(self.voice_score_q).tolist(),
            calibration=self.calibration, code_version=self.code_version, created=self.created,
        )

    def properties(self, sink_layers: tuple[int, int] | None = None, sink_threshold: float = 0.3) -> dict:
        """The testbed's properties the paper's methods rely on, from the calibration's `head_attention` and the
        voice scores: `first_token` the mean attention on position 0 over the KV heads of layers
        [sink_layers[0], sink_layers[1]) (None: the upper 60% of the layers, 12-29 of 30), `sink_heads` the KV heads
        (all layers) above `sink_threshold` there, `audio_positions_90` the median over heads of the fewest audio
        positions holding 90% of a head's audio mass (a fraction of the audio), `voice_score_top3` and
        `voice_score_median`."""
        ha = self.calibration.get("head_attention")
        if not ha:
            raise HeadScoresError(f"{self.path or 'these head scores'}: no calibration.head_attention (calibrated "
                                  "before it was recorded): run wnw-calibrate again")
        first = np.asarray(ha["first_token"], dtype=np.float64)
        lo, hi = sink_layers if sink_layers is not None else (int(round(0.4 * self.n_layers)), self.n_layers)
        vs = np.sort(np.asarray(self.voice_score, dtype=np.float64).ravel())[::-1]
        return dict(first_token=round(float(first[lo:hi].mean()), 4), first_token_layers=[lo, hi - 1],
                    sink_heads=int((first > sink_threshold).sum()), n_kv_heads_total=int(first.size),
                    audio_positions_90=round(float(np.median(ha["audio_positions_90"])), 4),
                    voice_score_top3=[round(float(v), 4) for v in vs[:3]],
                    voice_score_median=round(float(np.median(vs)), 5),
                    n_samples=self.calibration.get("n_samples"), dataset=self.calibration.get("dataset"))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "HeadScores":
        path = Path(path).expanduser()
        if not path.is_file():
            raise HeadScoresError(f"head-score file {path} does not exist: run wnw-calibrate for this model "
                                  "and pass its head_scores.json as method.head_scores=PATH")
        try:
            d = json.loads(path.read_text())
            if d.get("format") != FORMAT:
                raise KeyError(f"format is {d.get('format')!r}, expected {FORMAT!r}")
            out = cls(model=d["model"], n_layers=int(d["n_layers"]), n_q_heads=int(d["n_q_heads"]),
                      n_kv_heads=int(d["n_kv_heads"]), head_dim=int(d.get("head_dim") or 0),
                      token_rate=float(d["token_rate"]),
                      voice_score=np.asarray(d["voice_score"], dtype=np.float64),
                      head_sensitivity=np.asarray(d["head_sensitivity"], dtype=np.float64),
                      voice_score_q=None if d.get("voice_score_q") is None
                      else np.asarray(d["voice_score_q"], dtype=np.float64),
                      calibration=d.get("calibration") or {}, code_version=d.get("code_version") or {},
                      created=d.get("created"), path=str(path))
        except (KeyError, TypeError, ValueError) as e:
            raise HeadScoresError(f"{path} is not a valid head-score file ({e}); re-run wnw-calibrate") from None
        shape = (out.n_layers, out.n_kv_heads)
        for name in ("voice_score", "head_sensitivity"):
            arr = getattr(out, name)
            if arr.shape != shape or not np.all(np.isfinite(arr)):
                raise HeadScoresError(f"{path}: {name} has shape {arr.shape} (expected {shape}) or non-finite "
                                      "values; re-run wnw-calibrate")
        return out

    def check_matches(self, backbone_info: dict) -> None:
        """Refuse scores calibrated on another model or head layout, naming both and the fix."""
        if not backbone_info:
            return
        mine = dict(model=self.model, **{k: getattr(self, k) for k in LAYOUT_KEYS})
        theirs = dict(model=backbone_info.get("name"), **{k: backbone_info.get(k) for k in LAYOUT_KEYS})
        if any(theirs[k] is not None and mine[k] != theirs[k] for k in mine):
            raise HeadScoresError(
                f"head-score file {self.path or '(in memory)'} was calibrated for {_layout(mine)}, but this run "
                f"uses {_layout(theirs)}. Run `wnw-calibrate model={theirs['model']}` and pass the "
                f"head_scores.json it writes as method.head_scores=PATH.")


def _layout(d: dict) -> str:
    return (f"model {d['model']!r} ({d['n_layers']} layers x {d['n_kv_heads']} KV heads, "
            f"{d['n_q_heads']} query heads per layer)")


def shipped_path(model_name: str) -> Path:
    return shipped_head_scores(model_name)


def resolve_head_scores(head_scores: str | None, backbone_info: dict) -> HeadScores:
    """Load `method.head_scores` (a path, or None for the file shipped for the model) and validate it."""
    model = (backbone_info or {}).get("name")
    if head_scores in (None, "", "null", "shipped"):
        path = shipped_path(str(model))
        if not path.is_file():
            raise HeadScoresError(
                f"no head-score file is shipped for model {model!r} ({path} does not exist). Run "
                f"`wnw-calibrate model={model}` (see the README's calibration section) and pass the "
                "head_scores.json it writes as method.head_scores=PATH")
    else:
        path = Path(head_scores)
    scores = HeadScores.load(path)
    scores.check_matches(backbone_info)
    return scores


def code_version() -> dict:
    import wnw_exp

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=Path(__file__).parent).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, timeout=5, cwd=Path(__file__).parent).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return dict(wnw_exp=wnw_exp.__version__, git_commit=commit, git_dirty=dirty)
