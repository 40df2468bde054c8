"""The calibration loop behind `wnw-calibrate`: samples -> per-sample scores -> head_scores.json.

Knows nothing of Hydra: it takes plain dicts, like engine/runner.py.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from wnw_exp.backbones import load_backbone, resolve_device, resolve_dtype, set_cpu_threads
from wnw_exp.calibration.alignment import build_aligner
from wnw_exp.head_scores import HeadScores, code_version
from wnw_exp.rundir import NOT_IDENTITY
from wnw_exp.methods import registered_methods
from wnw_exp.calibration.scores import (answer_token_words, default_k_top, group_mean, score_sample,
                                        token_audio_spans)
from wnw_exp.engine.decode import max_new_tokens_for
from wnw_exp.engine.serve import generate
from wnw_exp.data import build_dataset


def calibrate(backbone, dataset, aligner, *, k_top: int | str = "auto", hs_tokens: int | None = None,
              recall_samples: int | None = None, max_new_tokens: Callable[[float], int] | None = None,
              progress: bool = True, log: Path | None = None) -> tuple[HeadScores, list[dict]]:
    """Head scores of `backbone` over `dataset`, word spans from `aligner`. Returns the scores and one
    record per sample (tokens counted, seconds). Then each method measures what it needs from the head scores
    (`Policy.calibrate`; WnW: how fast its anchors' attention moves) on the first `recall_samples` samples (None:
    all), decoding them with at most `max_new_tokens(duration_s)` tokens."""
    k = default_k_top(backbone.token_rate) if k_top in (None, "auto") else int(k_top)
    hits, sens, records, forced, stats = [], [], [], [], []
    n_vs = n_hs = 0
    for sample in tqdm(dataset, desc=f"calibrate {backbone.name}", disable=not progress, unit="sample"):
        if sample.task != "transcribe":
            raise ValueError(f"sample {sample.id} is a {sample.task!r} sample: calibrate on transcription data "
                             "(word alignments of the reference must match the audio)")
        words = aligner.words(sample)
        audio = sample.audio()
        prompt = backbone.build_prompt(audio, sample.task, sample.language, sample.target_language)
        answer_ids, word_of = answer_token_words(backbone.tokenizer, sample.reference)
        spans = token_audio_spans(word_of, words, backbone.token_rate, prompt.n_audio)
        res = score_sample(backbone, prompt, answer_ids, spans, k, hs_tokens)
        if recall_samples is None or len(forced) < recall_samples:
            forced.append((prompt, len(audio) / 16000))
        if res.hit is not None:
            hits.append(res.hit)
        sens.append(res.sensitivity)
        stats.append(res.attention)
        n_vs += res.n_vs_tokens
        n_hs += res.n_hs_tokens
        rec = dict(id=sample.id, n_answer_tokens=len(answer_ids), n_aligned_words=sum(w is not None for w in words),
                   n_words=len(words), n_vs_tokens=res.n_vs_tokens, n_hs_tokens=res.n_hs_tokens,
                   n_audio_tokens=prompt.n_audio, seconds=round(res.seconds, 3))
        records.append(rec)
        if log is not None:
            with open(log, "a") as f:
                f.write(json.dumps(rec) + "\n")
    if not sens:
        raise ValueError("the calibration set is empty")
    if not hits:
        raise ValueError("no answer token had an aligned word: check the alignments (alignment.min_word_score, "
                         "wnw-align output) — the voice score needs word spans")
    hit_q = np.mean(hits, axis=0)  # (L, H_q): mean over samples of the per-sample token mean
    info = backbone.describe()
    scores = HeadScores(
        model=info["name"], n_layers=info["n_layers"], n_q_heads=info["n_q_heads"], n_kv_heads=info["n_kv_heads"],
        head_dim=info["head_dim"], token_rate=info["token_rate"],
        voice_score=group_mean(hit_q, info["n_kv_heads"]), head_sensitivity=np.mean(sens, axis=0),
        voice_score_q=hit_q,
        calibration=dict(n_samples=len(sens), n_samples_with_aligned_tokens=len(hits), n_vs_tokens=n_vs,
                         n_hs_tokens=n_hs, k_top=k, hs_tokens=hs_tokens, alignment=aligner.describe(),
                         sample_ids=[r["id"] for r in records],
                         # what kind of heads the model has (the mean over samples of `scores.attention_statistics`)
                         head_attention={name: np.mean([st[name] for st in stats], axis=0).round(6).tolist()
                                         for name in stats[0]}),
        code_version=code_version(),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )
    if forced and max_new_tokens is not None:
        def decode(policy, prompt, retention: float, seconds: float):
            return generate(backbone, prompt, policy, retention=retention, max_new_tokens=max_new_tokens(seconds))

        for cls in registered_methods().values():
            if "calibrate" in vars(cls):  # each hook once, not again for a method that inherits it
                scores.calibration.update(cls.calibrate(scores, forced, decode, info, progress=progress))
    return scores, records


class OutputTaken(ValueError):
    """The output already holds head scores of another recipe (`check_output_is_free`)."""


def check_output_is_free(output: Path, cfg: dict) -> None:
    """The default output folder names the model, data set, split, n and alignment only; a calibration of other
    clips (other lengths, voices, text or seed) or another alignment would silently replace a finished file made for
    a different recipe. Same recipe: the file is recomputed in place. The dataset keys that do not choose the clips
    are those a run directory leaves out of its identity (`rundir.NOT_IDENTITY`: the cache folder, n, shards)."""
    if not output.exists():
        return
    try:
        old = json.loads(output.read_text())
        old_cal, old_model = old["calibration"], old["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # not a head-score file we made: HeadScores.save overwrites it as before
    ignored = {k.split(".", 1)[1] for k in NOT_IDENTITY if k.startswith("dataset.")}
    diff = []
    if old_model != cfg["model"]["name"]:
        diff.append(f"model {old_model} -> {cfg['model']['name']}")
    for group in ("dataset", "alignment"):
        was, now = old_cal.get(group) or {}, cfg.get(group) or {}
        diff += [f"{group}.{k}={was[k]!r} -> {now[k]!r}" for k in sorted(set(was) & set(now))
                 if not (group == "dataset" and k in ignored) and was[k] != now[k]]
    if diff:
        raise OutputTaken(f"{output} holds head scores calibrated on other data ({'; '.join(diff[:4])}): pass "
                          "output=PATH or calibration_root=DIR to keep both, or delete the file to replace it")


def run_calibration(cfg: dict, output: Path, progress: bool = True) -> HeadScores:
    """`wnw-calibrate` without Hydra: `cfg` holds model, dataset, alignment, device, dtype, seed, k_top,
    hs_tokens. Writes `output` (head_scores.json) and `calibration.jsonl` beside it; refuses (OutputTaken, before
    any work) to overwrite a head-score file calibrated on other clips or another alignment."""
    check_output_is_free(Path(output), cfg)
    device = resolve_device(cfg.get("device", "auto"))
    dtype = resolve_dtype(cfg.get("dtype", "auto"), device)
    set_cpu_threads(cfg.get("cpu_threads"), device)
    torch.manual_seed(cfg.get("seed", 0))
    dataset = build_dataset(cfg["dataset"])
    aligner = build_aligner(cfg["alignment"])
    backbone = load_backbone(cfg["model"], device, dtype)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    log = output.parent / "calibration.jsonl"
    log.unlink(missing_ok=True)
    model = cfg["model"]
    scores, _ = calibrate(backbone, dataset, aligner, k_top=cfg.get("k_top", "auto"), hs_tokens=cfg.get("hs_tokens"),
                          recall_samples=cfg.get("recall_samples"),
                          max_new_tokens=lambda seconds: max_new_tokens_for(
                              seconds, model["max_new_tokens_per_second"], model["min_new_tokens"]),
                          progress=progress, log=log)
    scores.calibration["dataset"] = {k: v for k, v in cfg["dataset"].items()}
    scores.calibration.update(device=str(device), dtype=str(dtype).replace("torch.", ""))
    scores.save(output)
    return scores
