"""The run directory, the only contract between running and reporting.

predictions.jsonl is appended and flushed per sample; a torn last line (a killed run) is detected and
dropped so the sample is recomputed; metrics.json is always recomputed from the file.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from wnw_exp.metrics import corpus_bleu, corpus_wer_counts

PREDICTIONS = "predictions.jsonl"
METRICS = "metrics.json"


def read_predictions(run_dir: Path, repair: bool = False) -> list[dict]:
    """Finished samples, in file order, the last record of an id winning. A torn final line is ignored
    (and cut from the file when `repair`)."""
    path = Path(run_dir) / PREDICTIONS
    if not path.exists():
        return []
    raw = path.read_bytes()
    records, good_bytes = {}, 0
    for line in raw.splitlines(keepends=True):
        try:
            rec = json.loads(line)
            if not line.endswith(b"\n"):
                raise ValueError("unterminated line")
        except ValueError:
            break
        records[rec["id"]] = rec
        good_bytes += len(line)
    if repair and good_bytes < len(raw):
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    return list(records.values())


def append_prediction(run_dir: Path, record: dict) -> None:
    with open(Path(run_dir) / PREDICTIONS, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _median(xs):
    xs = [x for x in xs if x is not None and x == x]
    return statistics.median(xs) if xs else None


def _mean(xs):
    xs = [x for x in xs if x is not None and x == x]
    return sum(xs) / len(xs) if xs else None


def aggregate(records: list[dict]) -> dict:
    """metrics.json from prediction records: corpus WER over the samples that did not fail, etc."""
    ok = [r for r in records if r.get("error") is None]
    counts = corpus_wer_counts([(r["reference"], r["hypothesis"]) for r in ok if r.get("task") != "translate"])
    translate = [(r["reference"], r["hypothesis"]) for r in ok if r.get("task") == "translate"]
    return dict(
        wer=counts.wer_percent if counts.ref_words else None,
        wer_counts=dict(substitutions=counts.substitutions, deletions=counts.deletions,
                        insertions=counts.insertions, ref_words=counts.ref_words),
        bleu=corpus_bleu(translate) if translate else None,
        r_gpu=_mean(r["r_gpu"] for r in ok),
        r_gpu_cpu=_mean(r["r_gpu_cpu"] for r in ok),
        r_gpu_end=_mean(r.get("r_gpu_end") for r in ok),
        r_gpu_cpu_end=_mean(r.get("r_gpu_cpu_end") for r in ok),
        ms_per_token=_median(r["ms_per_token"] for r in ok),
        mb_per_step=_mean(r["mb_per_step"] for r in ok),
        terminated_rate=_mean(float(r["terminated"]) for r in ok),
        n_samples=len(records),
        n_failed=len(records) - len(ok),
    )


def write_metrics(run_dir: Path, metrics: dict) -> None:
    tmp = Path(run_dir) / (METRICS + ".tmp")
    tmp.write_text(json.dumps(metrics, indent=2) + "\n")
    os.replace(tmp, Path(run_dir) / METRICS)
