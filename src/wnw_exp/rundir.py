"""The run directory, the only contract between running and reporting.

predictions.jsonl is appended and flushed per sample; a torn last line (a killed run) is detected and
dropped so the sample is recomputed; metrics.json is always recomputed from the file, over the samples the
run's configuration selects (listed in it as `sample_ids`).

A directory holds the results of one *identity*: the resolved config minus NOT_IDENTITY. Its short hash
ends the directory's name (conf/config.yaml), identity.json stores it readably, and resuming under another
identity is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from collections.abc import Mapping
from pathlib import Path

from wnw_exp.metrics import corpus_bleu, corpus_wer_counts
from wnw_exp.paths import file_digest, shipped_head_scores

PREDICTIONS = "predictions.jsonl"
TIMINGS = "timings.jsonl"
METRICS = "metrics.json"
LOCK = ".lock"
IDENTITY = "identity.json"
# Wall-clock fields differ between two runs of the same config, so they live in timings.jsonl and
# predictions.jsonl stays byte-identical for a given config and seed on the CPU.
TIMING_FIELDS = ("ms_per_token", "prefill_ms")


# The only config keys that cannot change a sample's prediction, so they are left out of the identity: where
# the run directory and the synthetic clip cache live (runs_root, dataset.cache_dir, dataset.cache), how the
# run is shown (progress), where and how fast it computes (device, engine: the decode path, batch_size: samples decoded together, each
# with results identical to batch_size=1, kv_pool_gb and kv_host_gb, the memory they share, and kv_reserve, the room admission
# keeps in it; cpu_threads), which samples it selects
# (dataset.n, dataset.shard, dataset.num_shards: a sample's prediction does not depend on the others selected
# with it). Every other key, present or future, is in the identity. The dtype actually computed in (dtype=auto
# is bfloat16 on a GPU, float32 on the CPU) is stored and checked next to it, see identity_record.
NOT_IDENTITY = ("runs_root", "progress", "device", "engine", "batch_size", "kv_pool_gb", "kv_host_gb", "kv_reserve", "cpu_threads",
                "dataset.n", "dataset.shard", "dataset.num_shards", "dataset.cache_dir", "dataset.cache")


# Files a data root holds that a run does not read as audio: their contents are in the identity (`read_files`).
AUDIO_SUFFIXES = (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".webm", ".aac")


def identity(cfg: Mapping) -> dict:
    """The result-affecting part of a resolved config: all of it but NOT_IDENTITY, plus, for a model whose trained
    weights ship with the package (or sit in `model.trained_dir`), their fingerprint (`model_weights`): weights
    trained further give a new directory rather than a mix of two versions' samples; and the content digest of
    every other file the run reads besides audio (`files`, `read_files`): a file edited in place gives a new
    directory too."""
    from wnw_exp.shipped_weights import weights_fingerprint

    out = json.loads(json.dumps(dict(cfg), default=str))
    if isinstance(out.get("model"), dict) and (fp := weights_fingerprint(out["model"])) is not None:
        out["model_weights"] = fp
    if files := read_files(out):
        out["files"] = files
    for dotted in NOT_IDENTITY:
        *parents, leaf = dotted.split(".")
        node = out
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return out


def read_files(cfg: Mapping) -> dict[str, str]:
    """{config key: content digest} of what a run with `cfg` reads besides audio and the trained weights of
    `model_weights`: the weights folder `model.path` (every file; a hub model instead by its cached snapshot's
    revision, a commit hash that names its content), the head-score file `method.head_scores` (null: the one
    shipped for the model), the manifest `dataset.path` and the non-audio files under a data root `dataset.root`
    (transcripts, annotations). A path that does not exist digests as "missing" (loading it fails later with its
    own message)."""
    model, method, data = (cfg.get(k) if isinstance(cfg.get(k), dict) else {} for k in ("model", "method", "dataset"))
    out = {}
    if model.get("path"):
        out["model.path"] = path_digest(Path(model["path"]))
    elif model.get("repo_id") and not model.get("random") and (rev := _hub_revision(model["repo_id"])):
        out["model.repo_id"] = rev
    if "head_scores" in method:
        path = (Path(method["head_scores"]) if method["head_scores"]
                else shipped_head_scores(str(model.get("name"))))
        out["method.head_scores"] = path_digest(path)
    if data.get("path"):
        out["dataset.path"] = path_digest(Path(data["path"]))
    if data.get("root"):
        out["dataset.root"] = path_digest(Path(data["root"]), skip_suffixes=AUDIO_SUFFIXES)
    return out


def path_digest(path: Path, skip_suffixes: tuple[str, ...] = ()) -> str:
    """16 hex digits of the SHA-256 of a file's bytes, or of a folder's files (their relative paths and digests,
    hidden entries and `skip_suffixes` left out); "missing" where nothing is there. Each file's digest is cached
    (`file_digest`), so only new or changed files are read."""
    path = Path(path).expanduser()
    if path.is_file():
        return file_digest(path)
    if not path.is_dir():
        return "missing"
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = f.relative_to(path)
        if any(part.startswith(".") for part in rel.parts) or f.suffix.lower() in skip_suffixes:
            continue
        h.update(f"{rel.as_posix()}\0{file_digest(f)}\n".encode())
    return h.hexdigest()[:16]


def _hub_revision(repo_id: str) -> str | None:
    """The commit of the hub snapshot `repo_id` loads from the local cache (None: not cached, or no hub library)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - no hub library or an unusable cache: the repo id alone names the model
        return None
    return Path(found).parent.name if isinstance(found, str) else None


def identity_hash(cfg: Mapping) -> str:
    """8 hex digits of the SHA-256 of the identity: the `cfg-<hash>` that ends a run directory's name."""
    return hashlib.sha256(json.dumps(identity(cfg), sort_keys=True).encode()).hexdigest()[:8]


def identity_record(cfg: Mapping, compute_dtype: str) -> dict:
    """What identity.json holds: the hash, the identity it hashes, and the dtype the samples are computed in."""
    return dict(id=identity_hash(cfg), compute_dtype=compute_dtype, config=identity(cfg))


def check_identity(run_dir: Path, record: dict) -> None:
    """Refuse to add samples to a run directory whose predictions were computed under another identity.

    A directory without identity.json (made before it existed) or without predictions accepts any.
    """
    path, predictions = Path(run_dir) / IDENTITY, Path(run_dir) / PREDICTIONS
    if not (path.exists() and predictions.exists() and predictions.stat().st_size > 0):
        return
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path} is not readable JSON ({e}): restore it, or move the run directory away") from e
    if stored != record:
        diffs = _differences({k: v for k, v in stored.items() if k != "id"},
                             {k: v for k, v in record.items() if k != "id"})
        more = f" and {len(diffs) - 3} more" if len(diffs) > 3 else ""
        raise ValueError(f"{run_dir} holds samples computed with another configuration ({'; '.join(diffs[:3])}"
                         f"{more}): resume it with those settings, or give this run its own directory")


def write_identity(run_dir: Path, record: dict) -> None:
    """identity.json: written when a run starts computing samples (atomically, like metrics.json)."""
    tmp = Path(run_dir) / (IDENTITY + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, Path(run_dir) / IDENTITY)


def _differences(stored: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(stored) | set(new)):
        a, b = stored.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {json.dumps(a)} there, {json.dumps(b)} now")
    return out


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


def _max(xs):
    xs = [x for x in xs if x is not None and x == x]
    return max(xs) if xs else None


def _mean(xs):
    xs = [x for x in xs if x is not None and x == x]
    return sum(xs) / len(xs) if xs else None


def aggregate(records: list[dict]) -> dict:
    """metrics.json from prediction records: corpus WER over the samples that did not fail, etc.

    `records` are the finished samples the configuration selects; `sample_ids` lists them, so a reader of the
    run directory counts the same samples even when predictions.jsonl holds more (a run with a larger n).
    """
    ok = [r for r in records if r.get("error") is None]
    counts = corpus_wer_counts([(r["reference"], r["hypothesis"]) for r in ok if r.get("task") != "translate"])
    translate = [(r["reference"], r["hypothesis"]) for r in ok if r.get("task") == "translate"]
    return dict(
        wer=counts.wer_percent if counts.ref_words else None,
        wer_counts=dict(substitutions=counts.substitutions, deletions=counts.deletions,
                        insertions=counts.insertions, ref_words=counts.ref_words),
        bleu=corpus_bleu(translate) if translate else None,
        r_gpu=_mean(r["r_gpu"] for r in ok),
        r_gpu_max=_max(r.get("r_gpu_max") for r in ok),  # the peak of any sample at any decode step
        r_gpu_cpu=_mean(r["r_gpu_cpu"] for r in ok),
        r_gpu_end=_mean(r.get("r_gpu_end") for r in ok),
        r_gpu_cpu_end=_mean(r.get("r_gpu_cpu_end") for r in ok),
        ms_per_token=_median(r["ms_per_token"] for r in ok),
        mb_per_step=_mean(r["mb_per_step"] for r in ok),
        terminated_rate=_mean(float(r["terminated"]) for r in ok),
        n_samples=len(records),
        n_failed=len(records) - len(ok),
        sample_ids=[r["id"] for r in records],
    )


def write_metrics(run_dir: Path, metrics: dict) -> None:
    tmp = Path(run_dir) / (METRICS + ".tmp")
    tmp.write_text(json.dumps(metrics, indent=2) + "\n")
    os.replace(tmp, Path(run_dir) / METRICS)
