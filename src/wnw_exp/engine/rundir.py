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
TIMINGS = "timings.jsonl"
METRICS = "metrics.json"
LOCK = ".lock"
# Wall-clock fields differ between two runs of the same config, so they live in timings.jsonl and
# predictions.jsonl stays byte-identical for a given config and seed on the CPU.
TIMING_FIELDS = ("ms_per_token", "prefill_ms")


def read_predictions(run_dir: Path, repair: bool = False) -> list[dict]:
    """Finished samples, in file order, with their timing fields joined in from timings.jsonl.

    The last record of an id wins. A torn final line (a killed run) is ignored, and cut from the file
    when `repair`, so that sample is recomputed.
    """
    timings = {r["id"]: r for r in _read_jsonl(Path(run_dir) / TIMINGS, repair)}
    return [{**r, **{k: timings.get(r["id"], {}).get(k) for k in TIMING_FIELDS}}
            for r in _read_jsonl(Path(run_dir) / PREDICTIONS, repair)]


def _read_jsonl(path: Path, repair: bool) -> list[dict]:
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
    """Append one finished sample: its timing first, then the prediction that marks it done."""
    timing = {"id": record["id"], **{k: record.get(k) for k in TIMING_FIELDS}}
    _append(Path(run_dir) / TIMINGS, timing)
    _append(Path(run_dir) / PREDICTIONS, {k: v for k, v in record.items() if k not in TIMING_FIELDS})


def _append(path: Path, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


class RunDirLock:
    """An exclusive lock on a run directory: two runs writing one directory would interleave samples."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.fd: int | None = None

    def __enter__(self) -> "RunDirLock":
        import fcntl

        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self.fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise RuntimeError(f"another run (pid {holder}) is writing to {self.path.parent}; wait for it to "
                               "finish or give this run other overrides (a different run directory)") from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, str(os.getpid()).encode())
        return self

    def __exit__(self, *exc) -> None:
        import fcntl

        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


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
