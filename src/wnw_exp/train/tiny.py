"""`wnw-train-tiny`: train, evaluate and export the embedded default model (`model=tiny`).

    wnw-train-tiny train  --run-dir outputs/train-tiny --minutes 9      # resumes from run-dir if it holds a checkpoint
    wnw-train-tiny train  --run-dir outputs/train-tiny --init-from src/wnw_exp/backbones/tiny_model   # or from the shipped model
    wnw-train-tiny export --run-dir outputs/train-tiny                  # -> src/wnw_exp/backbones/tiny_model/
    wnw-train-tiny eval   --model src/wnw_exp/backbones/tiny_model --n 50 --device cpu

`train` runs until `--minutes` of wall-clock time have passed or `--total-steps` are done, saving a
checkpoint every `--save-minutes` and at the end; run it again with the same `--run-dir` to go on.
The curriculum, the learning-rate schedule and the data stream are functions of the step, so a run
split into several sessions trains like one run (except that the optimizer's moments are rebuilt,
with a short warm-up, when a session starts from a checkpoint without `optimizer.pt`).
See the README section "Training the tiny model" for the recipe and the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import time
from collections import defaultdict
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerFast, VoxtralForConditionalGeneration, WhisperFeatureExtractor

from wnw_exp.backbones.audio_windows import device_features, windowed_features
from wnw_exp.backbones.word_tokenizer import EOS, SPECIAL_TOKENS, build_word_tokenizer, transcription_prompt
from wnw_exp.data.synthetic import DEFAULT_VOCAB_SIZE, SyntheticDataset, vocabulary
from wnw_exp.train import write_log

from .data import CURRICULUM, TRAIN_VOICES, Stage, SyntheticBatches, stage_at
from .model import N_MELS, FrameHeads, LossWeights, TinyArch, build_tiny_model, training_losses, use_guided_attention

MODEL_DIR = Path(__file__).resolve().parents[1] / "backbones" / "tiny_model"
GUIDED_HEADS = (0, 1)  # query heads 0 and 1 (KV head 0) of every decoder layer but the first


def scaled_curriculum(total_steps: int) -> tuple[Stage, ...]:
    """The curriculum's stage boundaries scaled from the reference 3000-step plan to `total_steps`."""
    return tuple(s if s.until >= 10**9 else replace(s, until=round(s.until * total_steps / 3000)) for s in CURRICULUM)


def batch_curriculum(curriculum: tuple[Stage, ...], windows: int) -> tuple[Stage, ...]:
    return tuple(replace(s, windows=windows) for s in curriculum) if windows else curriculum


def lr_at(step: int, total: int, peak: float, warmup: int, resumed_at: int | None) -> float:
    w = min(1.0, (step + 1) / warmup)
    if resumed_at is not None:  # fresh optimizer moments after a resume: ramp again, briefly
        w = min(w, (step - resumed_at + 1) / 50)
    progress = min(1.0, step / max(1, total))
    return peak * w * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def feature_extractor() -> WhisperFeatureExtractor:
    return WhisperFeatureExtractor(feature_size=N_MELS)


def _cpu_state(model, heads, meta) -> dict:
    cpu = lambda sd: {k: v.detach().cpu() for k, v in sd.items()}  # noqa: E731
    return {"model": cpu(model.state_dict()), "heads": cpu(heads.state_dict()), "meta": meta}


# --- train --------------------------------------------------------------------------------------


def train(args: argparse.Namespace) -> None:
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    device = _device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    words = vocabulary("en", args.vocab_size)
    tokenizer = build_word_tokenizer(words)
    vocab = SPECIAL_TOKENS + words
    assert tokenizer.convert_tokens_to_ids(vocab) == list(range(len(vocab)))
    arch = TinyArch(**json.loads(args.arch)) if args.arch else TinyArch()

    state_path, optim_path = run / "state.pt", run / "optimizer.pt"
    model = build_tiny_model(len(vocab), arch, seed=args.seed)
    heads = FrameHeads(arch.text_hidden, len(vocab))
    meta = {"step": 0, "next_index": 0, "train_seconds": 0.0, "sessions": [], "args": vars(args),
            "arch": asdict(arch), "vocab_size": args.vocab_size}  # fmt: skip
    if state_path.exists():
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        heads.load_state_dict(state["heads"])
        meta = state["meta"]
    elif args.init_from:  # an exported model folder: its weights and training record, fresh frame heads
        folder = Path(args.init_from)
        record = json.loads((folder / "training_meta.json").read_text())
        saved = VoxtralForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
        model.load_state_dict(saved.state_dict())
        if args.init_heads:  # the frame heads of the same checkpoint (`torch.save(state["heads"], ...)`)
            heads.load_state_dict(torch.load(args.init_heads, map_location="cpu", weights_only=True))
        meta = {k: v for k, v in record.items() if k != "created_with"} | {"args": record.get("created_with", vars(args))}
        for name in ("train_log.jsonl", "eval_log.jsonl"):  # carry the history on, so an export has all of it
            if (folder / name).exists() and not (run / name).exists():
                shutil.copyfile(folder / name, run / name)
    if meta["vocab_size"] != args.vocab_size or meta["arch"] != asdict(arch):
        raise SystemExit(f"the checkpoint in {run} / {args.init_from} has another vocabulary or architecture")
    model.to(device).train()
    heads.to(device).train()
    use_guided_attention(model, True)
    params = [p for p in list(model.parameters()) + list(heads.parameters()) if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-8, fused=device.type == "cuda")  # fmt: skip
    resumed_at = None
    if optim_path.exists() and state_path.exists():
        opt.load_state_dict(torch.load(optim_path, map_location=device, weights_only=False))
    elif meta["step"] > 0:
        resumed_at = meta["step"]

    total = args.total_steps
    curriculum = batch_curriculum(scaled_curriculum(total), args.batch_windows)
    if args.clip_seconds:  # fine-tuning: one stage of mixed lengths replaces the curriculum
        lo, hi = args.clip_seconds
        curriculum = (Stage(10**9, lo, hi, args.batch_windows or CURRICULUM[-1].windows),)
    step = mp.Value("i", meta["step"])
    stream = SyntheticBatches(vocab, args.seed, meta["next_index"], step,
                              args.vocab_size, curriculum, TRAIN_VOICES)  # fmt: skip
    loader = DataLoader(stream, batch_size=None, num_workers=args.workers, pin_memory=device.type == "cuda",
                        prefetch_factor=4 if args.workers else None, persistent_workers=False)  # fmt: skip
    extractor = feature_extractor()
    weights = LossWeights()
    guided_layers = tuple(range(1, arch.text_layers))
    log_f = open(run / "train_log.jsonl", "a")
    session = {"started_step": meta["step"], "args": vars(args), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
               else "cpu", "start_time": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    t0 = time.time()
    last_save = t0
    acc = defaultdict(float)
    n_acc = 0
    next_index = meta["next_index"]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    print(f"training from step {meta['step']} to {total} on {device}, {sum(p.numel() for p in model.parameters())/1e6:.2f} M params", flush=True)

    def save(final: bool) -> None:
        meta["step"] = step.value
        meta["next_index"] = next_index
        meta["train_seconds"] = meta.get("train_seconds", 0.0) + (time.time() - save.t_mark)
        save.t_mark = time.time()
        tmp = run / "state.pt.tmp"
        torch.save(_cpu_state(model, heads, meta), tmp)
        os.replace(tmp, state_path)
        if args.save_optimizer:
            torch.save(opt.state_dict(), run / "optimizer.pt.tmp")
            os.replace(run / "optimizer.pt.tmp", optim_path)

    save.t_mark = t0
    data_wait = 0.0
    it = iter(loader)
    while step.value < total and time.time() - t0 < args.minutes * 60:
        tw = time.time()
        batch = next(it)
        data_wait += time.time() - tw
        next_index = max(next_index, int(batch.pop("next_index")) + args.workers)
        n_words, audio_s = int(batch.pop("n_words")), float(batch.pop("audio_seconds"))
        feats = device_features(batch.pop("windows"), extractor, device)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        batch["features"] = feats
        lr = lr_at(step.value, total, args.lr, args.warmup, resumed_at)
        for g in opt.param_groups:
            g["lr"] = lr
        with autocast:
            loss, logs = training_losses(model, heads, batch, guided_layers, GUIDED_HEADS, weights)
        opt.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            print(f"step {step.value}: non-finite loss {logs}, skipped", flush=True)
            continue
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        if not torch.isfinite(gnorm):
            print(f"step {step.value}: non-finite gradient, skipped", flush=True)
            continue
        opt.step()
        with step.get_lock():
            step.value += 1
        for k, v in logs.items():
            acc[k] += v
        acc["words"] += n_words
        acc["audio_seconds"] += audio_s
        acc["grad_norm"] += float(gnorm)
        n_acc += 1
        if step.value % args.log_every == 0 or step.value == total:
            rec = {k: (v / n_acc if k not in ("words", "audio_seconds") else v) for k, v in acc.items()}
            stage = stage_at(step.value - 1, curriculum)
            rec.update(step=step.value, lr=lr, seconds=round(meta["train_seconds"] + time.time() - save.t_mark, 1),
                       clip_seconds=[stage.min_seconds, stage.max_seconds], data_wait=round(data_wait, 1))  # fmt: skip
            write_log(log_f, rec)
            acc.clear()
            n_acc = 0
        if time.time() - last_save > args.save_minutes * 60:
            save(False)
            last_save = time.time()
    save(True)
    session.update(end_step=step.value, seconds=round(time.time() - t0, 1), data_wait=round(data_wait, 1))
    meta["sessions"].append(session)
    torch.save(_cpu_state(model, heads, meta), state_path)
    log_f.close()
    del it, loader
    if args.eval_clips:
        use_guided_attention(model, False)
        model.eval()
        stage = stage_at(min(step.value, total - 1), curriculum)
        res = evaluate(model, tokenizer, extractor, device, n=args.eval_clips, split="dev",
                       min_seconds=stage.min_seconds, max_seconds=stage.max_seconds, vocab_size=args.vocab_size,
                       workers=args.workers)  # fmt: skip
        res.update(step=step.value, clip_seconds=[stage.min_seconds, stage.max_seconds])
        with open(run / "eval_log.jsonl", "a") as f:
            f.write(json.dumps({k: v for k, v in res.items() if k != "predictions"}) + "\n")
        print("eval", {k: v for k, v in res.items() if k != "predictions"}, flush=True)


# --- evaluation (plain greedy generate) ---------------------------------------------------------


def _synth(args):
    ds = SyntheticDataset(**args[0])
    s = ds[args[1]]
    return s.id, s.audio(), s.reference


def synthetic_clips(n, split, min_seconds, max_seconds, vocab_size, workers, seed=0) -> list[tuple[str, np.ndarray, str]]:
    kw = dict(n=n, split=split, seed=seed, min_seconds=min_seconds, max_seconds=max_seconds, vocab_size=vocab_size,
              voices=list(TRAIN_VOICES))  # fmt: skip
    if workers > 1:
        with mp.get_context("fork").Pool(workers) as pool:
            return pool.map(_synth, [(kw, i) for i in range(n)])
    return [_synth((kw, i)) for i in range(n)]


@torch.no_grad()
def greedy_transcribe(model, tokenizer, extractor, audios: list[np.ndarray], device, max_words: list[int],
                      batch_size: int = 16) -> list[tuple[str, bool]]:  # fmt: skip
    """Greedy `generate()` transcripts and whether each one ended with `</s>`.

    Clips with the same number of 30 s windows have prompts of the same length, so they are batched
    without padding.
    """
    feats = [windowed_features(a, extractor, device) for a in audios]
    out: list[tuple[str, bool] | None] = [None] * len(audios)
    groups = defaultdict(list)
    for i, f in enumerate(feats):
        groups[f.shape[0]].append(i)
    for nw, idx in sorted(groups.items()):
        for b in range(0, len(idx), batch_size):
            part = idx[b : b + batch_size]
            ids = torch.tensor([transcription_prompt(375 * nw)] * len(part), device=device)
            gen = model.generate(input_ids=ids, input_features=torch.cat([feats[i] for i in part]).to(model.dtype),
                                 attention_mask=torch.ones_like(ids), max_new_tokens=max(max_words[i] for i in part),
                                 do_sample=False, eos_token_id=EOS, pad_token_id=EOS)  # fmt: skip
            for row, i in zip(gen[:, ids.shape[1] :].tolist(), part):
                row = row[: max_words[i]]
                ended = EOS in row
                row = row[: row.index(EOS)] if ended else row
                out[i] = (tokenizer.decode(row, skip_special_tokens=True), ended)
    return out  # type: ignore[return-value]


def evaluate(model, tokenizer, extractor, device, n, split, min_seconds, max_seconds, vocab_size, workers=1) -> dict:
    from wnw_exp.metrics.text import corpus_wer

    t0 = time.time()
    clips = synthetic_clips(n, split, min_seconds, max_seconds, vocab_size, workers)
    t_synth = time.time() - t0
    refs = [c[2] for c in clips]
    max_words = [int(1.5 * len(r.split())) + 10 for r in refs]
    hyps = greedy_transcribe(model, tokenizer, extractor, [c[1] for c in clips], device, max_words)
    preds = [{"id": c[0], "reference": r, "hypothesis": h, "terminated": t} for c, r, (h, t) in zip(clips, refs, hyps)]
    return {
        "split": split, "n": n, "wer": corpus_wer([(p["reference"], p["hypothesis"]) for p in preds]),
        "terminated_rate": float(np.mean([p["terminated"] for p in preds])),
        "device": str(device), "synth_seconds": round(t_synth, 1), "decode_seconds": round(time.time() - t0 - t_synth, 1),
        "predictions": preds,
    }  # fmt: skip


def load_model(path: str | Path, device) -> tuple:
    model = VoxtralForConditionalGeneration.from_pretrained(path, dtype=torch.float32).to(device).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    extractor = WhisperFeatureExtractor.from_pretrained(path)
    return model, tokenizer, extractor


def eval_cmd(args: argparse.Namespace) -> None:
    device = _device(args.device)
    model, tokenizer, extractor = load_model(args.model, device)
    vocab_size = len(tokenizer) - len(SPECIAL_TOKENS)
    res = evaluate(model, tokenizer, extractor, device, args.n, args.split, args.min_seconds, args.max_seconds,
                   vocab_size, args.workers)  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            for p in res["predictions"]:
                f.write(json.dumps(p) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "predictions"}))


# --- export -------------------------------------------------------------------------------------


def export(args: argparse.Namespace) -> None:
    """Write the model folder that `model=tiny` loads: weights (<16 MB shards), tokenizer, features, logs."""
    run, out = Path(args.run_dir), Path(args.out)
    state = torch.load(run / "state.pt", map_location="cpu", weights_only=False)
    meta = state["meta"]
    words = vocabulary("en", meta["vocab_size"])
    model = build_tiny_model(len(SPECIAL_TOKENS) + len(words), TinyArch(**meta["arch"]))
    model.load_state_dict(state["model"])
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("model*.safetensors*"):
        f.unlink()
    model.config.text_config._attn_implementation = "sdpa"
    model.save_pretrained(out, max_shard_size="15MB")
    build_word_tokenizer(words).save_pretrained(out)
    feature_extractor().save_pretrained(out)
    for name in ("train_log.jsonl", "eval_log.jsonl"):
        if (run / name).exists():
            shutil.copyfile(run / name, out / name)
    write_training_log(out, meta, args.note)
    (out / "training_meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "args"} |
                                                       {"created_with": meta["args"]}, indent=1))  # fmt: skip
    print(f"exported step {meta['step']} to {out}")


def write_training_log(out: Path, meta: dict, note: str = "") -> None:
    """`training_log.md`: GPU time, sessions, the last logged losses and every WER measured."""
    rows = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()] if (out / "train_log.jsonl").exists() else []
    evals = [json.loads(x) for x in (out / "eval_log.jsonl").read_text().splitlines()] if (out / "eval_log.jsonl").exists() else []
    lines = [
        "# Training log of the tiny model",
        "",
        *([note, ""] if note else []),
        f"Step {meta['step']}; training-loop time on the GPU {meta['train_seconds'] / 60:.1f} min "
        f"over {len(meta['sessions'])} session(s) (data-loader start-up and the end-of-session evaluation not included).",
        "",
        "| session | device | started | steps | seconds |",
        "| --- | --- | --- | --- | --- |",
    ]
    for i, x in enumerate(meta["sessions"], 1):
        lines.append(f"| {i} | {x['device']} | {x['start_time']} | {x['started_step']}-{x['end_step']} | {x['seconds']} |")
    if rows:
        last = rows[-1]
        keys = ["loss", "ce", "token_acc", "frame", "frame_acc", "frame_prev", "guided", "guided_acc", "audio_rms"]
        lines += ["", f"Last logged training losses (means over the logging interval ending at step {last['step']}, clips of "
                  f"{last['clip_seconds'][0]:.0f}-{last['clip_seconds'][1]:.0f} s):", "",
                  "| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys),
                  "| " + " | ".join(f"{last[k]:.4g}" for k in keys) + " |"]  # fmt: skip
    if evals:
        lines += ["", "Greedy truncated WER (`wnw-train-tiny eval`, plain `generate()`, fp32):", "",
                  "| step | split | clips | clip length (s) | device | WER % | terminated |", "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for e in evals:
            lo, hi = e.get("clip_seconds", ["?", "?"])
            lines.append(f"| {e['step']} | {e['split']} | {e['n']} | {lo}-{hi} | {e['device']} | {e['wer']:.2f} | {e['terminated_rate']:.2f} |")
    lines += ["", "Per-step records: `train_log.jsonl`; sessions and their arguments: `training_meta.json`.", ""]
    (out / "training_log.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="wnw-train-tiny", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train (or resume) the tiny model")
    t.add_argument("--run-dir", default="outputs/train-tiny")
    t.add_argument("--minutes", type=float, default=9.0, help="wall-clock budget of this session")
    t.add_argument("--total-steps", type=int, default=3000)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=200)
    t.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    t.add_argument("--device", default="auto")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    t.add_argument("--init-from", default="", help="start from an exported model folder when run-dir has no checkpoint")
    t.add_argument("--clip-seconds", type=float, nargs=2, metavar=("MIN", "MAX"), default=None,
                   help="replace the curriculum by one stage of MIN..MAX s clips (fine-tuning on mixed lengths)")
    t.add_argument("--init-heads", default="", help="with --init-from: a .pt of the frame heads' state dict")
    t.add_argument("--batch-windows", type=int, default=0, help="30 s windows per batch (0: the curriculum's)")
    t.add_argument("--arch", default="", help="JSON overrides of TinyArch (for smoke tests)")
    t.add_argument("--log-every", type=int, default=25)
    t.add_argument("--save-minutes", type=float, default=2.0)
    t.add_argument("--save-optimizer", action="store_true", help="also save AdamW moments (large)")
    t.add_argument("--eval-clips", type=int, default=8, help="greedy WER on this many dev clips at the end")
    e = sub.add_parser("eval", help="greedy truncated WER and termination on synthetic clips")
    e.add_argument("--model", default=str(MODEL_DIR))
    e.add_argument("--n", type=int, default=50)
    e.add_argument("--split", default="test")
    e.add_argument("--min-seconds", type=float, default=120.0)
    e.add_argument("--max-seconds", type=float, default=240.0)
    e.add_argument("--device", default="auto")
    e.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    e.add_argument("--out", default="")
    x = sub.add_parser("export", help="write the shipped model folder from a run's checkpoint")
    x.add_argument("--run-dir", default="outputs/train-tiny")
    x.add_argument("--out", default=str(MODEL_DIR))
    x.add_argument("--note", default="", help="a paragraph put at the top of training_log.md")
    args = p.parse_args(argv)
    {"train": train, "eval": eval_cmd, "export": export}[args.cmd](args)


if __name__ == "__main__":
    main()
