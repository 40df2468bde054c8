"""One run: every sample of a data set through one backbone and one method, into a run directory.

Knows nothing of Hydra: it takes plain dicts. Resumes from predictions.jsonl; a failing sample is recorded
with its error and the run goes on. SIGINT and SIGTERM abandon the sample being computed, write metrics.json
for the finished ones and raise `Interrupted`. Messages (samples already done, failed samples, an interruption)
go to the `wnw_exp.engine.runner` logger: the console and run.log under wnw-run.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import signal
import subprocess
import threading
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import wnw_exp
from wnw_exp.backbones import load_backbone, resolve_device, resolve_dtype, set_cpu_threads
from wnw_exp.data import build_dataset
from wnw_exp.engine.decode import max_new_tokens_for
from wnw_exp.engine.serve import generate
from wnw_exp.rundir import (RunDirLock, aggregate, append_prediction, check_identity, identity_record,
                                   read_predictions, write_identity, write_metrics)
from wnw_exp.methods import build_policy
from wnw_exp.metrics import corpus_wer_counts

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run (`signum`); the finished samples are kept."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _StopOnSignal:
    """SIGINT and SIGTERM (what SLURM sends before a requeue) raise Interrupted wherever the run is, abandoning
    the sample being computed (it is recomputed on resume); while a finished sample is written (`hold`), a
    signal only marks the stop, raised once the write is whole. Installed only from the main thread (Python
    runs signal handlers there), and the previous handlers are put back."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.holding = False
        self.previous: dict = {}

    def __enter__(self) -> "_StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        if not self.holding:
            raise Interrupted(signum)

    @contextmanager
    def hold(self):
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.signum is not None:
            raise Interrupted(self.signum)


# `engine=`: which decode path `generate` takes (docs/gpu.md). auto: the reference store and step on the CPU, the
# packed store with the fused step in a CUDA graph on a GPU; eager: the same without the graph; reference: the
# reference store and step on any device (the specification every other path is tested against).
ENGINE_PATHS = {"auto": {}, "eager": dict(graph=False), "reference": dict(store="reference", fused=False, graph=False)}


def check_config(cfg: dict) -> None:
    r = cfg["retention"]
    if not isinstance(r, (int, float)) or not 0 < r <= 1:
        raise ValueError(f"retention={r!r} is outside (0, 1]: it is the fraction of audio KV kept on the device")
    if cfg.get("engine", "auto") not in ENGINE_PATHS:
        raise ValueError(f"engine={cfg['engine']!r}: choose one of {', '.join(ENGINE_PATHS)}")
    bs = cfg.get("batch_size", 1)
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        raise ValueError(f"batch_size={bs!r}: the number of samples decoded together, a whole number >= 1")
    gb = cfg.get("kv_pool_gb")
    if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb > 0):
        raise ValueError(f"kv_pool_gb={gb!r}: the KV pool batched streams share on the GPU, in GB (> 0), or null "
                         "for 80% of the free device memory")
    host = cfg.get("kv_host_gb")
    if host is not None and (isinstance(host, bool) or not isinstance(host, (int, float)) or not host >= 0):
        raise ValueError(f"kv_host_gb={host!r}: the pinned host memory for batched streams' host mirrors, in GB "
                         "(>= 0), or null for twice the KV pool")
    res = cfg.get("kv_reserve")
    if res is not None and (isinstance(res, bool) or not isinstance(res, (int, float)) or res < 0
                            or (isinstance(res, float) and res > 1)):
        raise ValueError(f"kv_reserve={res!r}: the answer tokens a batched stream's admission keeps pool room for: a "
                         "whole number of tokens >= 0, a fraction of the answer's cap in [0.0, 1.0], or null for 0.6 "
                         "of the cap")


def environment(device: torch.device) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    import transformers

    return dict(wnw_exp=wnw_exp.__version__, git_commit=commit, torch=torch.__version__,
                transformers=transformers.__version__, python=platform.python_version(), device=str(device),
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None)


def write_environment(run_dir: Path, env: dict, n_done: int) -> None:
    """environment.json: the environment computing samples now at the top level, and under `history` every
    `wnw-run` that computed samples in the directory, oldest first, each with the count of predictions already
    there when it started (`samples_before`): a run resumed under another commit or device says which samples came
    from which."""
    path = run_dir / "environment.json"
    before = json.loads(path.read_text()) if path.exists() else None
    history = [] if before is None else before.get("history", [before])
    path.write_text(json.dumps(dict(env, history=[*history, dict(env, samples_before=n_done)]), indent=2) + "\n")


def run(cfg: dict, run_dir: Path, progress: bool = True) -> dict:
    """Run (or resume) the experiment `cfg` into `run_dir`; returns metrics.json's content.

    metrics.json covers the finished samples that `cfg` selects (predictions of other samples in the
    directory, e.g. from a run with a larger `dataset.n`, stay valid and are kept).
    """
    check_config(cfg)
    run_dir = Path(run_dir)
    (run_dir / "trace").mkdir(parents=True, exist_ok=True)
    with RunDirLock(run_dir), _StopOnSignal() as stop:
        return _run_locked(cfg, run_dir, progress, stop)


def _run_locked(cfg: dict, run_dir: Path, progress: bool, stop: _StopOnSignal) -> dict:
    device = resolve_device(cfg["device"])
    dtype = resolve_dtype(cfg["dtype"], device)
    identity = identity_record(cfg, str(dtype).removeprefix("torch."))
    check_identity(run_dir, identity)
    set_cpu_threads(cfg.get("cpu_threads"), device)
    dataset = build_dataset(cfg["dataset"])
    selected = dataset.ids
    done = {r["id"]: r for r in read_predictions(run_dir, repair=True)}
    n_done = sum(i in done for i in selected)
    if n_done:
        log.info(f"{n_done} of {len(selected)} samples already done")
    interrupted = None
    try:
        if any(i not in done for i in selected):  # (a finished run is re-aggregated: no model is loaded)
            _run_missing(cfg, run_dir, device, dtype, identity, dataset, selected, done, progress, stop)
    except Interrupted as e:
        stop.holding = True  # a second signal must not cut metrics.json short
        interrupted = e
    records = [done[i] for i in selected if i in done]
    metrics = aggregate(records) | dict(n_selected=len(selected))  # n_samples < n_selected: interrupted
    write_metrics(run_dir, metrics)
    if interrupted is not None:
        log.warning(f"interrupted: {len(records)} of {len(selected)} samples kept; rerun the same command to resume")
        raise interrupted
    return metrics


def _run_missing(cfg, run_dir, device, dtype, identity, dataset, selected, done, progress, stop) -> None:
    """Decode the selected samples not in `done`, adding each to `done` once its prediction line is written."""
    torch.manual_seed(cfg["seed"])
    backbone = load_backbone(cfg["model"], device, dtype)
    policy = build_policy(cfg["method"], backbone.describe())
    policy.check(cfg["retention"])
    if cfg.get("analysis") == "mismatch":
        from wnw_exp.methods.mismatch import MismatchRecorder

        policy = MismatchRecorder(policy)
    elif cfg.get("analysis") is not None:
        raise ValueError(f"unknown analysis {cfg['analysis']!r}: use analysis=mismatch or leave it null")
    write_environment(run_dir, environment(device), n_done=len(done))
    write_identity(run_dir, identity)  # what the samples below are computed under

    bar = tqdm(total=len(selected), initial=sum(i in done for i in selected),
               desc=f"{cfg['model']['name']}/{cfg['method']['name']} r={cfg['retention']}", disable=not progress,
               unit="sample")

    def finished(record: dict) -> None:
        """Write a finished sample at once (whatever the others of its batch are doing): a run never loses it."""
        sample_id = record["id"]
        trace = record.pop("trace", None)
        with stop.hold():
            if trace is not None:  # the trace first: a sample is done once its prediction line exists
                (run_dir / "trace" / f"{sample_id}.json").write_text(json.dumps(trace))
            append_prediction(run_dir, record)
            done[sample_id] = record
        if record["error"] is not None:
            log.warning(f"sample {sample_id} failed: {record['error']}")
        ended = [done[j] for j in selected if j in done]
        ok = [r for r in ended if r.get("error") is None]
        counts = corpus_wer_counts([(r["reference"], r["hypothesis"]) for r in ok])
        bar.set_postfix(wer=f"{counts.wer_percent:.1f}" if counts.ref_words else "-", failed=len(ended) - len(ok))
        bar.update(1)

    todo = [(i, sample_id) for i, sample_id in enumerate(selected) if sample_id not in done]
    try:
        if cfg.get("batch_size", 1) == 1:
            for i, _ in todo:
                finished(_run_sample(dataset[i], backbone, policy, cfg))
        else:
            _run_batched([dataset[i] for i, _ in todo], backbone, policy, cfg, finished)
    finally:
        bar.close()


def _check_fits(backbone, seconds: float, per_s: float, minimum: int) -> None:
    """The backbone's refusal of audio that cannot fit its positions with its answer, naming the real limit.

    The answer's cap grows with the audio, so the longest audio that fits is found by bisection on the
    backbone's own check.
    """
    def fits(s: float) -> bool:
        try:
            backbone.check_fits(s, max_new_tokens_for(s, per_s, minimum))
            return True
        except ValueError:
            return False

    if fits(seconds):
        return
    lo, hi = 0.0, seconds
    for _ in range(40):
        lo, hi = ((lo + hi) / 2, hi) if fits((lo + hi) / 2) else (lo, (lo + hi) / 2)
    raise ValueError(f"audio of {seconds:.0f} s and its answer need more than the {backbone.max_positions} positions "
                     f"of {backbone.name}: the limit is about {lo:.0f} s; cut the recording")


def _run_sample(sample, backbone, policy, cfg) -> dict:
    base = _base(sample)
    try:
        prompt, cap = _prompt(sample, backbone, cfg)
        res = generate(backbone, prompt, policy, retention=cfg["retention"], max_new_tokens=cap,
                       **ENGINE_PATHS[cfg.get("engine", "auto")])
        return _record(base, sample, prompt, res, backbone)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # noqa: BLE001 - a failed sample is recorded, the run goes on
        return _failed(base, e)


def _run_batched(samples: list, backbone, policy, cfg: dict, finished) -> None:
    """`batch_size` samples decoded together (`engine.serve.decode_batch`, each with its own fork of `policy`);
    each one's record goes to `finished` as soon as it ends. On CUDA the streams share one KV pool (`kv_pool_gb`;
    null: 80% of the device memory free after the weights); a stream it cannot hold waits for one to leave, and
    one joins only while the pool keeps room for `kv_reserve` answer tokens of every stream (null: 0.6 of its cap)."""
    from wnw_exp.engine.serve import Request, decode_batch, default_pool

    path = ENGINE_PATHS[cfg.get("engine", "auto")]
    waiting: dict = {}

    def requests():
        for sample in samples:
            try:
                prompt, cap = _prompt(sample, backbone, cfg)
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as e:  # noqa: BLE001 - a failed sample is recorded, the run goes on
                finished(_failed(_base(sample), e))
                continue
            waiting[sample.id] = (sample, prompt)
            yield Request(sample.id, prompt, cap)

    pool = None
    if path.get("store") != "reference":
        gb = cfg.get("kv_pool_gb")
        pool = default_pool(backbone, gb, host_gb=cfg.get("kv_host_gb"), cpu_tier=policy.cpu_tier)
        if gb is not None and pool is None:
            warnings.warn(f"kv_pool_gb={gb}: the KV pool is the GPU's; on {backbone.device.type} each stream has its "
                          "own store", stacklevel=2)
    for key, res in decode_batch(backbone, requests(), policy.fork, retention=cfg["retention"],
                                 max_concurrent=cfg["batch_size"], pool=pool, reserve_tokens=cfg.get("kv_reserve"),
                                 **path):
        sample, prompt = waiting.pop(key)
        if isinstance(res, Exception):
            finished(_failed(_base(sample), res, res.__traceback__))
        else:
            finished(_record(_base(sample), sample, prompt, res, backbone))


def _base(sample) -> dict:
    duration = sample.duration if sample.duration == sample.duration else None  # NaN: header unreadable
    return dict(id=sample.id, reference=sample.reference, task=sample.task, duration=duration)


def _prompt(sample, backbone, cfg):
    """The sample's prompt and its answer's length cap; raises on audio that cannot be decoded."""
    per_s, minimum = cfg["model"]["max_new_tokens_per_second"], cfg["model"]["min_new_tokens"]
    if _base(sample)["duration"] is not None:  # from the audio header, before anything is decoded
        _check_fits(backbone, sample.duration, per_s, minimum)
    audio = sample.audio()
    if len(audio) == 0:
        raise ValueError("the audio file holds no samples")
    not_finite = int(np.count_nonzero(~np.isfinite(audio)))
    if not_finite:
        raise ValueError(f"the audio holds {not_finite} NaN or infinite values (of {len(audio)} at 16 kHz): "
                         "the recording is corrupt")
    prompt = backbone.build_prompt(audio, sample.task, sample.language, sample.target_language)
    return prompt, max_new_tokens_for(len(audio) / 16000, per_s, minimum)


def _record(base: dict, sample, prompt, res, backbone) -> dict:
    tokens = [t for t in res.tokens if t not in backbone.eos_token_ids]
    s = res.store_summary
    return dict(base, hypothesis=backbone.decode(tokens), n_new_tokens=len(res.tokens),
                terminated=res.terminated, r_gpu=s["r_gpu"], r_gpu_max=s["r_gpu_max"], r_gpu_cpu=s["r_gpu_cpu"],
                r_gpu_end=s["r_gpu_end"],
                r_gpu_cpu_end=s["r_gpu_cpu_end"], ms_per_token=_finite(res.ms_per_token),
                mb_per_step=s["mb_per_step"], prefill_ms=res.prefill_ms, n_audio_tokens=prompt.n_audio,
                audio_bytes_on_device=s["audio_bytes_on_device"], knobs=res.knobs, error=None,
                trace=dict(res.trace, reference_words=len(sample.reference.split()),
                           reference_tokens=backbone.count_tokens(sample.reference)))


def _failed(base: dict, e: BaseException, tb=None) -> dict:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()
    trace = "".join(traceback.format_exception(type(e), e, tb, limit=3)) if tb is not None else traceback.format_exc(limit=3)
    return dict(base, hypothesis="", n_new_tokens=0, terminated=False, r_gpu=None, r_gpu_cpu=None,
                ms_per_token=None, mb_per_step=None, error=f"{type(e).__name__}: {e}", error_trace=trace)


def _finite(x: float) -> float | None:
    return x if x == x and not math.isinf(x) else None

