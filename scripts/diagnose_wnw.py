#!/usr/bin/env python
"""Where WnW loses its place: a per-step trace of its resident set against the full-cache attention, and its figure.

    python scripts/diagnose_wnw.py trace --ids synthetic-test-8 synthetic-test-1 --out /tmp/diag [OVERRIDES...]
    python scripts/diagnose_wnw.py figure /tmp/diag/*.json --out docs/figures/wnw_diagnosis.png

`trace` decodes the named clips with WnW on the CPU reference path (fp32), wrapped in
`methods.placement_trace.PlacementTrace`, so the decode is WnW's own (the same tokens as `wnw-run` on the CPU) and
the trace adds, at each step, what the full cache would have attended to with the same query. The configuration is
`wnw-run`'s (src/wnw_exp/conf/), by default the 20-clip test set of the methods table: whisper_smollm2, synthetic natural text,
60-180 s, n=20, WnW at retention 0.2; OVERRIDES are Hydra overrides on top. One JSON per clip: the hypothesis, the
tokens, for every step the reference word being emitted and its time in the audio (the synthetic clips' exact word
timings, through the jiwer alignment of the hypothesis), and the trace.

`figure` draws, per clip, the audio position over decode steps (the word being emitted, the anchors' focus chunk,
the tidal heads' true focus segment, the recalled segments) above the mass kept (the tidal heads' mean, and all
heads' weighted by their audio share), marks the steps where the true focus jumps ahead of the word being emitted,
and prints those events (`events`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from wnw_exp.paths import conf_dir

TEST_SET = ["model=whisper_smollm2", "dataset=synthetic", "dataset.text=natural", "dataset.n=20",
            "dataset.min_seconds=60", "dataset.max_seconds=180", "method=wnw", "retention=0.2", "device=cpu",
            "dtype=float32"]


def compose(overrides: list[str]) -> dict:
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return OmegaConf.to_container(hydra_compose("config", overrides=TEST_SET + overrides), resolve=True)


def emitted_words(reference: str, tokens: list[int], decode) -> list[int | None]:
    """Per decode step, the index of the reference word the step's token belongs to (None: an inserted word or no
    word), from the jiwer alignment of the normalised hypothesis with the normalised reference (no truncation)."""
    import jiwer

    from wnw_exp.metrics.text import normalize

    ref = normalize(reference).split()
    hyp_at_step = []  # per step: how many normalised hypothesis words the text so far holds
    for k in range(1, len(tokens) + 1):
        hyp_at_step.append(len(normalize(decode(tokens[:k])).split()))
    hyp = normalize(decode(tokens)).split()
    ref_of_hyp: list[int | None] = [None] * len(hyp)
    if ref and hyp:
        for chunk in jiwer.process_words(" ".join(ref), " ".join(hyp)).alignments[0]:
            if chunk.type in ("equal", "substitute"):
                for j in range(chunk.hyp_end_idx - chunk.hyp_start_idx):
                    ref_of_hyp[chunk.hyp_start_idx + j] = chunk.ref_start_idx + j
    out = []
    for n in hyp_at_step:
        out.append(ref_of_hyp[n - 1] if 0 < n <= len(ref_of_hyp) else None)
    return out


def reference_word_times(sample) -> list[float]:
    """The middle of each normalised reference word in the audio (s), from the clip's word timings (a timed word
    that normalises to several words gives each its time); empty when the clip has no timings."""
    from wnw_exp.metrics.text import normalize

    times = []
    for w in sample.words or []:
        times += [0.5 * (w.start + w.end)] * len(normalize(w.text).split())
    return times if len(times) == len(normalize(sample.reference).split()) else []


def trace(ids: list[str], out: Path, overrides: list[str]) -> None:
    import torch

    from wnw_exp.backbones import load_backbone, resolve_device, resolve_dtype, set_cpu_threads
    from wnw_exp.data import build_dataset
    from wnw_exp.engine.decode import max_new_tokens_for
    from wnw_exp.engine.serve import generate
    from wnw_exp.methods import build_policy
    from wnw_exp.methods.placement_trace import PlacementTrace
    from wnw_exp.metrics import wer_counts

    cfg = compose(overrides)
    device = resolve_device(cfg["device"])
    dtype = resolve_dtype(cfg["dtype"], device)
    set_cpu_threads(cfg.get("cpu_threads"), device)
    torch.manual_seed(cfg["seed"])
    dataset = build_dataset(cfg["dataset"])
    unknown = [i for i in ids if i not in dataset.ids]
    if unknown:
        sys.exit(f"diagnose_wnw: {', '.join(unknown)} not in the data set (its ids: {dataset.ids[0]} .. "
                 f"{dataset.ids[-1]}); name clips of the configured set")
    backbone = load_backbone(cfg["model"], device, dtype)
    policy = build_policy(cfg["method"], backbone.describe())
    policy.check(cfg["retention"])
    out.mkdir(parents=True, exist_ok=True)
    per_s, minimum = cfg["model"]["max_new_tokens_per_second"], cfg["model"]["min_new_tokens"]
    for sample_id in ids:
        sample = dataset[dataset.ids.index(sample_id)]
        audio = sample.audio()
        prompt = backbone.build_prompt(audio, sample.task, sample.language, sample.target_language)
        tracer = PlacementTrace(policy)
        res = generate(backbone, prompt, tracer, retention=cfg["retention"], store="reference",
                       max_new_tokens=max_new_tokens_for(len(audio) / 16000, per_s, minimum))
        tokens = [t for t in res.tokens if t not in backbone.eos_token_ids]
        hypothesis = backbone.decode(tokens)
        words = emitted_words(sample.reference, tokens, backbone.decode)
        word_times = reference_word_times(sample)
        times = [None if w is None or w >= len(word_times) else word_times[w] for w in words]
        counts = wer_counts(sample.reference, hypothesis)
        record = dict(id=sample_id, config=cfg, reference=sample.reference, hypothesis=hypothesis, tokens=tokens,
                      wer=counts.wer_percent, errors=counts.errors, ref_words=counts.ref_words,
                      terminated=res.terminated, knobs=res.knobs, r_gpu=res.store_summary["r_gpu"],
                      r_gpu_cpu=res.store_summary["r_gpu_cpu"], step_ref_word=words, step_time=times,
                      placement=res.trace["placement"], wnw=res.trace["wnw"])
        (out / f"{sample_id}.json").write_text(json.dumps(record))
        print(f"{sample_id}: WER {counts.wer_percent:.2f}% over {len(tokens)} tokens, r_GPU "
              f"{res.store_summary['r_gpu']:.4f} -> {out / (sample_id + '.json')}", flush=True)


OFFSET_BINS = (("behind, 3+", -10**9, -3), ("-2..-1", -2, -1), ("0", 0, 0), ("+1", 1, 1), ("+2..+6", 2, 6),
               ("ahead, 7+", 7, 10**9))


def offset_mass(placement: dict, emitted: list[int | None]) -> dict:
    """Per offset bin (segments relative to the word being emitted; the first segment, the audio's sink, apart):
    `share`, the bin's part of the tidal heads' true audio mass summed over the steps that emit a word, and `kept`,
    the part of the bin's mass that is resident."""
    import numpy as np

    mass, lost = np.asarray(placement["segment_mass"]), np.asarray(placement["segment_lost"])
    sums = {name: [0.0, 0.0] for name in ["sink"] + [b[0] for b in OFFSET_BINS]}
    for step, e in enumerate(emitted):
        if e is None:
            continue
        for seg in range(mass.shape[1]):
            name = "sink" if seg == 0 else next(b[0] for b in OFFSET_BINS if b[1] <= seg - e <= b[2])
            sums[name][0] += float(mass[step, seg])
            sums[name][1] += float(lost[step, seg])
    total = sum(m for m, _ in sums.values()) or 1.0
    return {name: dict(share=round(m / total, 3), kept=round(1 - l / m, 3) if m > 0 else None)
            for name, (m, l) in sums.items()}


def events(record: dict, ahead: int = 3) -> dict:
    """What the trace shows, in steps: `jumps`, the steps where the tidal heads' true focus leaves the word being
    emitted for a segment more than `ahead` segments further on (the first step of each such run, with where the
    focus was and went, the anchors' focus and whether the new focus was recalled), `first_miss` (the first step
    whose true focus segment is not recalled) and `n_miss`; `kept_tidal` (per step, the tidal heads' mean mass
    kept) and `kept_all` (per step, the share of all heads' full-cache audio attention that is resident: every
    head's kept mass weighted by its audio share); and, at the first jump (else the first miss), the five heads that
    lose the most audio attention over the ten steps before it (the mean of (1 - kept) x audio share). `skips`: the
    steps where the text itself leaves its passage, the word being emitted landing more than `ahead` segments after
    the last one emitted (the true focus moving with it is not a `jump`). `by_offset`: where the tidal heads' true
    audio mass lies relative to the segment of the word being emitted, over the steps that emit a word, and how much
    of each part is resident (`offset_mass`)."""
    import numpy as np

    p = record["placement"]
    kept, share = np.asarray(p["mass_kept"]), np.asarray(p["audio_share"])  # (steps, L, H)
    tidal = np.zeros(kept.shape[1:], bool)
    for li, k in p["tidal_heads"]:
        tidal[li, k] = True
    seg_seconds = p["n_s"] / p["token_rate"]
    emitted = [None if t is None else int(t // seg_seconds) for t in record["step_time"]]
    out = dict(n_steps=len(kept), first_miss=next((i for i, h in enumerate(p["hit"]) if not h), None),
               n_miss=sum(not h for h in p["hit"]), jumps=[],
               kept_tidal=kept[:, tidal].mean(axis=1).tolist() if tidal.any() else [1.0] * len(kept),
               kept_all=((kept * share).sum(axis=(1, 2)) / share.sum(axis=(1, 2))).tolist())
    away = False
    last = None
    for i, seg in enumerate(p["true_segment"]):
        last = emitted[i] if emitted[i] is not None else last
        now = last is not None and seg - last > ahead
        if now and not away:
            out["jumps"].append(dict(step=i, emitted_segment=last, true_segment=seg,
                                     anchor_chunk=p["anchor_chunk"][i], recalled=bool(p["hit"][i])))
        away = now
    last = None
    out["skips"] = []
    for i, seg in enumerate(emitted):
        if seg is not None and last is not None and seg - last > ahead:
            out["skips"].append(dict(step=i, from_segment=last, to_segment=seg))
        last = seg if seg is not None else last
    out["by_offset"] = offset_mass(p, emitted)
    at = out["jumps"][0]["step"] if out["jumps"] else out["first_miss"]
    if at is not None:
        lost = ((1 - kept) * share)[max(0, at - 10):at + 1].mean(axis=0)
        whole = (kept > 0.9999).all(axis=0)
        order = np.argsort(-lost, axis=None)[:5]
        out["worst_heads"] = [dict(layer=int(li), head=int(k), role="tidal" if tidal[li, k] else
                                   ("kept whole" if whole[li, k] else "fixed"),
                                   kept=round(float(kept[max(0, at - 10):at + 1, li, k].mean()), 3),
                                   audio_share=round(float(share[max(0, at - 10):at + 1, li, k].mean()), 3))
                              for li, k in zip(*np.unravel_index(order, lost.shape))]
    return out


def figure(paths: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    records = [json.loads(p.read_text()) for p in paths]
    fig, axes = plt.subplots(2, len(records), figsize=(5.2 * len(records), 6.4), squeeze=False,
                             gridspec_kw=dict(height_ratios=[2.2, 1]), sharex="col")
    for col, r in enumerate(records):
        p = r["placement"]
        sec = 1.0 / p["token_rate"]
        seg_mid = [(a + b) / 2 * sec for a, b in p["segments"]]
        chunk_mid = [(a + b) / 2 * sec for a, b in p["chunks"]]
        steps = np.arange(p["n_steps"])
        ax = axes[0, col]
        for s, rec in enumerate(p["recalled"]):  # the recalled segments in force, as grey ticks
            if rec:
                ax.scatter([s] * len(rec), [seg_mid[i] for i in rec], s=1.5, c="0.8", marker="s", linewidths=0)
        t = [np.nan if x is None else x for x in r["step_time"]]
        ax.plot(steps, t, ".", ms=2.5, c="black", label="word being emitted (reference timing)")
        ax.plot(steps, [chunk_mid[c] for c in p["anchor_chunk"]], ".", ms=2, c="tab:green",
                label="anchor focus (argmax chunk)")
        ax.plot(steps, [seg_mid[c] for c in p["true_segment"]], "x", ms=2.5, c="tab:red",
                label="tidal heads' true focus (argmax segment)")
        f = events(r)
        for jump in f["jumps"]:
            for a in axes[:, col]:
                a.axvline(jump["step"], ls="--", c="tab:purple", lw=0.8)
        options = ", ".join(f"{k}={r['config']['method'][k]}" for k in ("head_scale", "max_recalled", "locality")
                            if r["config"]["method"].get(k) not in (None, 0, "importance"))
        ax.set_title(f"{r['id']}: WER {r['wer']:.1f}%\nWnW r={r['config']['retention']:g}"
                     f"{', ' + options if options else ''}", fontsize=9)
        ax.set_ylabel("audio position (s)")
        ax2 = axes[1, col]
        ax2.plot(steps, f["kept_tidal"], c="tab:blue", lw=0.8, label="tidal heads, mean")
        ax2.plot(steps, f["kept_all"], c="tab:orange", lw=0.8, label="all heads, weighted by audio share")
        ax2.set_ylim(0, 1.02)
        ax2.set_ylabel("true audio mass kept")
        ax2.set_xlabel("decode step")
    axes[0, 0].legend(fontsize=7, loc="upper left", markerscale=3)
    axes[1, 0].legend(fontsize=7, loc="lower left")
    fig.suptitle("WnW's resident set against the full-cache attention, per decode step (grey: recalled segments; "
                 "dashed: the true focus jumps ahead of the word being emitted)", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    print(f"figure -> {out}")
    for r in records:
        f = events(r)
        kept_tidal, kept_all = np.mean(f.pop("kept_tidal")), np.mean(f.pop("kept_all"))
        print(r["id"], f"WER {r['wer']:.2f}%, mass kept over the clip: tidal heads {kept_tidal:.3f}, all heads "
              f"(weighted) {kept_all:.3f};", json.dumps(f))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace", help="decode clips with WnW and trace its placement")
    t.add_argument("--ids", nargs="+", required=True, help="sample ids of the configured data set")
    t.add_argument("--out", type=Path, required=True, help="folder for one JSON per clip")
    t.add_argument("overrides", nargs="*", help="Hydra overrides on top of the 20-clip test set")
    f = sub.add_parser("figure", help="draw the traces")
    f.add_argument("traces", nargs="+", type=Path)
    f.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.cmd == "trace":
        trace(args.ids, args.out, args.overrides)
    else:
        figure(args.traces, args.out)


if __name__ == "__main__":
    main()
