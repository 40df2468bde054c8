"""`wnw-train-projector`: train the projector of `model=whisper_smollm2` (and, if asked, LoRA adapters).

The encoder (Whisper-base) and the decoder (SmolLM2-135M-Instruct) stay frozen, as in SLAM-ASR: only the
projector (2048 -> 576 -> 576, 1.5 M parameters) learns to turn stacked encoder frames into embeddings the
pretrained LM reads as speech. `--lora-rank R` adds low-rank adapters to the decoder's attention
projections (q, k, v, o of every layer) for a second stage, to be used only if the projector alone leaves
the WER too high; they ship as `lora.safetensors` and are merged into the weights at load.

Data: natural-text synthetic speech (`synthesize_clip(text="natural", text_split="train")`: the train
subjects of the SmolLM2-written corpus, never a test, dev or calibration subject; the six English voices;
150-200 wpm), synthesised on the fly by DataLoader workers from the training seeds (1,000,000 + seed).
`--voices train_wide` (a preset of `wnw_exp.data.voices`, or comma-separated voice names) widens the voices and
rates, `--texts` mixes text domains (drawn per clip), `--augment light` adds speed, loudness, reverb and noise
variation (`wnw_exp.train.augment`); the defaults are the recipe of the shipped weights.
A batch holds whole 30 s windows up to `--batch-windows`. The loss is the cross-entropy of the answer
tokens (the transcript and `<|im_end|>`) given SmolLM2's chat prompt with the audio in the user turn,
exactly the prompt `wnw-run` builds (`voxtral.chat_prompt_ids`).

Schedule: the learning rate (linear warm-up, cosine decay to a tenth) and the stages (`--stages`: short clips
first, then the full 20-240 s range) follow the session's progress, the larger of step / `--total-steps`
and elapsed / `--minutes`, so a time-limited session on a machine of unknown speed still anneals. A session
resumes from `RUN_DIR/state.pt` (the trained weights and the optimizer); its schedule starts again.

    wnw-train-projector train --run-dir RUN --minutes 6 --total-steps 2000 --workers 14 [--lora-rank 16]
    wnw-train-projector train --run-dir RUN --init-from src/wnw_exp/backbones/whisper_smollm2 --voices train_wide \
        --augment light ...   # the wide mixture, continuing from the shipped weights
    wnw-train-projector eval --run-dir RUN --n 20 --split dev --min-seconds 120 --max-seconds 240
    wnw-train-projector export --run-dir RUN --out src/wnw_exp/backbones/whisper_smollm2
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from wnw_exp.backbones import lora
from wnw_exp.backbones.audio_windows import device_features
from wnw_exp.backbones.voxtral import chat_prompt_ids
from wnw_exp.backbones.whisper_smollm2 import TRAINED_DIR, assemble
from wnw_exp.data.base import SAMPLE_RATE
from wnw_exp.data import piper_voices
from wnw_exp.data import voices as voice_sets
from wnw_exp.data.synthetic import (DEFAULT_RATE_RANGE, DEFAULT_VOICES, SPLIT_SEED_BASE, TEXTS, clip_voice,
                                    synthesize_clip)
from wnw_exp.train import write_log
from wnw_exp.train.augment import Augment, augment

WINDOW_SAMPLES = 30 * SAMPLE_RATE
TOKENS_PER_WINDOW = 375
TRAIN_SEED = SPLIT_SEED_BASE["train"]
VOICES = DEFAULT_VOICES["en"]
# (until this fraction of the session, min seconds, max seconds)
DEFAULT_STAGES = ((0.15, 4.0, 30.0), (0.4, 20.0, 120.0), (1.0, 20.0, 240.0))


def stage_at(progress: float, stages) -> tuple[float, float]:
    for until, lo, hi in stages:
        if progress < until:
            return lo, hi
    return stages[-1][1], stages[-1][2]


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to a tenth of the peak as progress goes 0 -> 1."""
    w = min(1.0, (step + 1) / warmup)
    progress = min(1.0, max(0.0, progress))
    return peak * w * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def to_windows(audio: np.ndarray) -> np.ndarray:
    """(n_windows, 480000) int16: the clip cut into 30 s windows, the last zero-padded (as `windowed_features`)."""
    nw = max(1, math.ceil(len(audio) / WINDOW_SAMPLES))
    out = np.zeros(nw * WINDOW_SAMPLES, np.int16)
    out[: len(audio)] = np.round(audio * 32768.0).clip(-32768, 32767).astype(np.int16)
    return out.reshape(nw, WINDOW_SAMPLES)


class NaturalClips(IterableDataset):
    """Endless batches of training clips; worker w synthesises clip indices first_index + w, + n_workers, ...

    `progress` (a shared multiprocessing.Value, 0 -> 1) is the session's progress; it picks the stage's clip
    lengths. A fraction `shuffle` of the natural-text clips (drawn per clip index) speak their sentences with the
    words in a random order (`text="shuffled"`), which the decoder cannot complete from its own language model.
    `voices` (a preset name or names) and `rate_range` (None: the preset's) pick the speakers, `texts` the text
    domains (one drawn per clip when there are several), `augment` an `Augment` recipe (None: off). A fraction
    `six_share` of the clips (drawn per clip index) is spoken by the six voices at their rates instead, the shipped
    weights' training voices, so that a wider mixture keeps them in view."""

    def __init__(self, tokenizer, seed: int, first_index: int, progress, stages, batch_windows: int,
                 shuffle: float = 0.0, voices="six", rate_range=None, texts=("natural",),
                 augment: Augment | None = None, six_share: float = 0.0):
        self.tokenizer, self.seed, self.first_index, self.progress = tokenizer, seed, first_index, progress
        self.stages, self.batch_windows, self.shuffle = stages, batch_windows, shuffle
        if not 0.0 <= six_share <= 1.0:
            raise ValueError(f"six_share={six_share}: give a fraction in [0, 1]")
        self.six_share = six_share
        self.voices, preset_rates = voice_sets.resolve(voices, "en")
        self.rate_range = tuple(rate_range) if rate_range else (preset_rates or DEFAULT_RATE_RANGE)
        self.texts, self.augment = tuple(texts), augment
        piper_voices.check(self.voices)  # missing packages fail here: the loop below skips clips that raise
        if "kjv" in self.texts:
            from wnw_exp.data.kjv import database

            database()

    def text_of(self, index: int) -> str:
        base = self.texts[0]
        if len(self.texts) > 1:
            base = self.texts[int(np.random.default_rng([TRAIN_SEED + self.seed, index, 4]).integers(len(self.texts)))]
        if self.shuffle <= 0 or base != "natural":
            return base
        return "shuffled" if np.random.default_rng([TRAIN_SEED + self.seed, index, 1]).random() < self.shuffle else "natural"

    def speakers_of(self, index: int) -> tuple[tuple[str, ...], tuple[int, int]]:
        """(voices, rate range) clip `index` draws its speaker from: the six voices for a `six_share` of the clips."""
        if self.six_share > 0 and np.random.default_rng([TRAIN_SEED + self.seed, index, 6]).random() < self.six_share:
            return voice_sets.SIX["en"], voice_sets.SIX_RATES
        return self.voices, self.rate_range

    def clip(self, index: int, lo: float, hi: float):
        """Training clip `index` (audio, words, whether its words are timed) of `lo`-`hi` seconds, augmented."""
        seed = TRAIN_SEED + self.seed
        voices, rates = self.speakers_of(index)
        audio, words = synthesize_clip(seed, index, text=self.text_of(index), text_split="train", voices=voices,
                                       rate_range=rates, min_seconds=lo, max_seconds=hi)
        if self.augment is not None:
            audio, words = augment(audio, words, self.augment, np.random.default_rng([seed, index, 3]))
        return audio, words, not piper_voices.is_neural(clip_voice(seed, index, voices))

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        index = self.first_index + wid
        while True:
            lo, hi = stage_at(self.progress.value, self.stages)
            windows, answers, frame_targets, used = [], [], [], 0
            while used < self.batch_windows:
                try:
                    audio, words, timed = self.clip(index, lo, hi)
                except RuntimeError:  # espeak could not time a run of sentences: skip that clip
                    index += nw
                    continue
                index += nw
                w = to_windows(audio)
                if used and used + len(w) > self.batch_windows:
                    break
                ids, frames = answer_and_frame_targets(self.tokenizer, words, len(w) * TOKENS_PER_WINDOW)
                if not timed:  # a neural voice: its words carry sentence spans, no frame targets
                    frames[:] = -100
                windows.append(w)
                answers.append(ids)
                frame_targets.append(frames)
                used += len(w)
            yield dict(windows=torch.from_numpy(np.concatenate(windows)), n_windows=[len(w) for w in windows],
                       answers=answers, frame_targets=torch.from_numpy(np.concatenate(frame_targets)),
                       next_index=index)


def answer_and_frame_targets(tokenizer, words, n_audio: int) -> tuple[list[int], np.ndarray]:
    """The transcript's token ids and, per audio token (80 ms), the first token of the word spoken at its centre
    (-100 in silence): the target of the optional frame loss (`--frame-loss`), which pulls each audio embedding
    towards the embedding of what is being said there."""
    from wnw_exp.calibration.scores import answer_token_words

    text = " ".join(x.text for x in words)
    ids, word_of = answer_token_words(tokenizer, text)
    first = {}
    for i, wi in enumerate(word_of):
        if wi is not None:
            first.setdefault(wi, ids[i])
    frames = np.full(n_audio, -100, np.int64)
    centres = (np.arange(n_audio) + 0.5) * (30.0 / TOKENS_PER_WINDOW)
    starts, ends = np.array([x.start for x in words]), np.array([x.end for x in words])
    k = np.searchsorted(starts, centres, side="right") - 1
    inside = (k >= 0) & (centres < ends[np.clip(k, 0, None)])
    frames[inside] = [first.get(int(j), -100) for j in k[inside]]
    return list(ids), frames


FRAME_TEMPERATURE = 0.05


def frame_loss(model, audio_embeds: torch.Tensor, frame_targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the cosine similarities (/ FRAME_TEMPERATURE) between each audio embedding and the
    decoder's token embeddings against `frame_targets`: it pulls an embedding's direction towards its word's
    token without rewarding a larger norm (the plain output layer would: its logits grow with the norm)."""
    table = F.normalize(model.model.language_model.embed_tokens.weight.float(), dim=-1)
    logits = F.normalize(audio_embeds.float(), dim=-1) @ table.t() / FRAME_TEMPERATURE
    return F.cross_entropy(logits, frame_targets.to(logits.device), ignore_index=-100)


def corrupted(answer: list[int], share: float, rng: np.random.Generator) -> list[int]:
    """The answer as the teacher-forced input sees it when `share` of its tokens are replaced by another token of
    the same answer (a plausible wrong word, or one from elsewhere in the passage, as when a greedy answer skips or
    repeats): the targets stay the true next tokens, so the model learns to take its place from the audio, not
    from its own (possibly wrong) last words (`--corrupt-inputs`)."""
    if share <= 0 or len(answer) < 2:
        return answer
    out = np.array(answer)
    hit = np.flatnonzero(rng.random(len(out)) < share)
    out[hit] = out[rng.integers(0, len(out), len(hit))]
    return out.tolist()


def sequence_batch(model, tokenizer, audio_embeds: torch.Tensor, n_windows: list[int], answers: list[list[int]],
                   corrupt: float = 0.0, rng: np.random.Generator | None = None):
    """(inputs_embeds (B, T, H), answer rows (B, R), targets (B, R) with -100 padding) for the teacher-forced pass;
    with `corrupt` > 0 the input copy of each answer is `corrupted` (the targets never are)."""
    dec = model.model.language_model
    audio_id, eos = model.config.audio_token_id, model.generation_config.eos_token_id
    seqs, rows, targets, chunks, start = [], [], [], [], 0
    for nw, ans in zip(n_windows, answers):
        n_audio = nw * TOKENS_PER_WINDOW
        prompt = chat_prompt_ids(tokenizer, audio_id, n_audio)
        seqs.append(prompt + corrupted(ans, corrupt, rng))
        rows.append(np.arange(len(ans) + 1) + len(prompt) - 1)
        targets.append(ans + [eos])
        chunks.append((prompt.index(audio_id), audio_embeds[start:start + n_audio]))
        start += n_audio
    B, T, R = len(seqs), max(map(len, seqs)), max(map(len, rows))
    dev = audio_embeds.device
    ids = torch.full((B, T), eos, dtype=torch.long)
    row_t = torch.zeros((B, R), dtype=torch.long)
    tgt_t = torch.full((B, R), -100, dtype=torch.long)
    for i in range(B):
        ids[i, : len(seqs[i])] = torch.tensor(seqs[i])
        row_t[i, : len(rows[i])] = torch.from_numpy(rows[i])
        tgt_t[i, : len(targets[i])] = torch.tensor(targets[i])
    embeds = dec.embed_tokens(ids.to(dev)).clone()
    for i, (at, a) in enumerate(chunks):
        embeds[i, at:at + a.shape[0]] = a.to(embeds.dtype)
    return embeds, row_t.to(dev), tgt_t.to(dev)


def answer_loss(model, embeds: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
    dec = model.model.language_model
    hidden = dec(inputs_embeds=embeds, use_cache=False).last_hidden_state  # causal; right padding is never seen
    picked = hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1]))
    logits = model.lm_head(picked).float()
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    mask = targets != -100
    acc = ((logits.argmax(-1) == targets) & mask).sum() / mask.sum()
    return loss, dict(ce=float(loss.detach()), token_acc=float(acc), answer_tokens=int(mask.sum()))


HELDOUT_TEXTS = ("natural", "shuffled")


def heldout_batch(tokenizer, n: int, text: str = "natural", split: str = "dev", min_seconds: float = 20.0,
                  max_seconds: float = 60.0) -> dict:
    """`n` clips of `split` (text never trained on) as one teacher-forced batch: the windows, their counts and the
    answers' token ids. With `text="shuffled"` the same sentences' words are spoken in a random order: what the
    decoder gets right there it read from the audio, not guessed from the text before."""
    from wnw_exp.calibration.scores import answer_token_words

    ds = synthesised(n=n, split=split, min_seconds=min_seconds, max_seconds=max_seconds, text=text)
    windows = [to_windows(s.audio()) for s in ds]
    return dict(windows=torch.from_numpy(np.concatenate(windows)), n_windows=[len(w) for w in windows],
                answers=[list(answer_token_words(tokenizer, s.reference)[0]) for s in ds])


def _synthesise(kw: dict, i: int) -> None:
    from wnw_exp.data.synthetic import SyntheticDataset

    SyntheticDataset(**kw)[i].audio()


def synthesised(**kw):
    """A cached `SyntheticDataset` (dev/test/calib splits) whose clips are synthesised side by side first, one
    process per clip up to the cores, into the clip cache; its samples then read them from there."""
    from wnw_exp.data.synthetic import SyntheticDataset

    ds = SyntheticDataset(**kw)
    if kw.get("n", 1) > 1:
        with mp.get_context("spawn").Pool(min(kw["n"], os.cpu_count() or 1)) as pool:
            pool.starmap(_synthesise, [(kw, i) for i in range(kw["n"])])
    return ds


@torch.no_grad()
def heldout_loss(model, tokenizer, batch: dict, feats: torch.Tensor) -> dict:
    """Teacher-forced answer CE and token accuracy of a `heldout_batch` (its features `feats`)."""
    was_training = model.training
    model.eval()
    embeds = audio_embeddings(model, feats)
    x, rows, targets = sequence_batch(model, tokenizer, embeds, batch["n_windows"], batch["answers"])
    _, logs = answer_loss(model, x, rows, targets)
    model.train(was_training)
    return dict(ce=logs["ce"], token_acc=logs["token_acc"])


def heldout_sets(tokenizer, extractor, device, n: int, **kw) -> dict:
    """{name: (batch, features)}: `n` dev clips of natural text (`heldout`) and the same number with shuffled
    words (`heldout_shuffled`). In the training log, the gap between the training CE and `heldout_ce` shows the
    adapters learning the training text; `heldout_shuffled_acc` how much of the speech the model reads."""
    out = {}
    for text in HELDOUT_TEXTS:
        batch = heldout_batch(tokenizer, n, text, **kw)
        out["heldout" if text == "natural" else f"heldout_{text}"] = (batch, device_features(batch["windows"],
                                                                                           extractor, device))
    return out


def audio_embeddings(model, feats: torch.Tensor) -> torch.Tensor:
    """The frozen encoder (no grad), then the trainable projector: (n_windows * 375, hidden)."""
    with torch.no_grad():
        enc = model.model.audio_tower(feats.to(model.model.audio_tower.conv1.weight.dtype)).last_hidden_state
    stacked = enc.reshape(-1, model.config.audio_config.intermediate_size)
    return model.model.multi_modal_projector(stacked)


@torch.no_grad()
def match_embedding_scale(model, feats: torch.Tensor) -> float:
    """Scale the fresh projector's last layer so its outputs have the element spread of the decoder's token
    embeddings (a random projector starts 3-4x larger: measured 0.45 against 0.136 on SmolLM2)."""
    out = audio_embeddings(model, feats).float().std()
    target = model.model.language_model.embed_tokens.weight.float().std()
    factor = float(target / out)
    model.model.multi_modal_projector.linear_2.weight.mul_(factor)
    print(f"projector output std {float(out):.4f} -> {float(target):.4f} (x{factor:.3f})", flush=True)
    return factor


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def trainable_state(model) -> dict:
    proj = {k: v.detach().float().cpu() for k, v in model.model.multi_modal_projector.state_dict().items()}
    adapters, meta = lora.state(model.model.language_model)
    return dict(projector=proj, lora=adapters, lora_meta=meta)


def read_trained(folder: Path) -> dict:
    """A trained folder's tensors in `trainable_state`'s layout."""
    from safetensors.torch import load_file

    adapters = folder / "lora.safetensors"
    return dict(projector=load_file(str(folder / "projector.safetensors")),
                lora={k: v.float() for k, v in load_file(str(adapters)).items()} if adapters.exists() else {})


def load_trainable(model, state: dict) -> None:
    model.model.multi_modal_projector.load_state_dict(state["projector"])
    if state.get("lora"):
        for name, mod in _lora_modules(model):
            mod.lora_A.data.copy_(state["lora"][f"{name}.lora_A"])
            mod.lora_B.data.copy_(state["lora"][f"{name}.lora_B"])


def _lora_modules(model):
    for li, layer in enumerate(model.model.language_model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, mod in parent.named_children():
                if isinstance(mod, lora.LoRALinear):
                    yield f"layers.{li}.{name}", mod


# --- train ---------------------------------------------------------------------------------------------------
def train(args: argparse.Namespace) -> None:
    from transformers import WhisperFeatureExtractor

    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    device = _device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    model, tokenizer, sources = assemble(None, seed=args.seed)
    state_path = run / "state.pt"
    meta = dict(step=0, next_index=0, train_seconds=0.0, sessions=[], sources=sources, lora_rank=0)
    state = None
    if state_path.exists():
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        meta = state["meta"]
    elif args.init_from:  # a shipped trained folder: its weights and record, a fresh optimizer
        state = dict(trainable=read_trained(Path(args.init_from)))
        meta = {**json.loads((Path(args.init_from) / "training_meta.json").read_text()), "init_from": args.init_from}
    lora_rank = args.lora_rank or meta.get("lora_rank", 0)
    for p in model.parameters():
        p.requires_grad_(False)
    if lora_rank:
        lora.attach(model.model.language_model, lora_rank, args.lora_alpha)
    if state is not None:
        load_trainable(model, state["trainable"])
    if lora_rank and not meta.get("lora_rank"):
        meta["lora_from_step"] = meta["step"]  # the step the adapters joined
    meta["lora_rank"] = lora_rank
    for p in model.model.multi_modal_projector.parameters():
        p.requires_grad_(True)
    model.to(device)
    model.train()
    proj_params = list(model.model.multi_modal_projector.parameters())
    lora_params = [p for _, m in _lora_modules(model) for p in (m.lora_A, m.lora_B)]
    for p in lora_params:
        p.requires_grad_(True)
    groups = [dict(params=proj_params, lr=args.lr, peak=args.lr)]
    if lora_params:
        groups.append(dict(params=lora_params, lr=args.lora_lr, peak=args.lora_lr))
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.98), weight_decay=0.0, fused=device.type == "cuda")
    if state is not None and state.get("optimizer") and len(state["optimizer"]["param_groups"]) == len(groups):
        opt.load_state_dict(state["optimizer"])
    total = args.total_steps
    stages = tuple(tuple(s) for s in json.loads(args.stages)) if args.stages else DEFAULT_STAGES
    step, first_step = meta["step"], meta["step"]
    progress = mp.Value("d", 0.0)
    stream = NaturalClips(tokenizer, args.seed, meta["next_index"], progress, stages, args.batch_windows,
                          shuffle=args.shuffle_words, voices=args.voices, rate_range=args.rate_range,
                          texts=args.texts, augment=args.augment, six_share=args.six_share)
    loader = DataLoader(stream, batch_size=None, num_workers=args.workers, pin_memory=device.type == "cuda",
                        prefetch_factor=4 if args.workers else None)
    extractor = WhisperFeatureExtractor(feature_size=80)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    heldout = heldout_sets(tokenizer, extractor, device, args.heldout) if args.heldout else {}
    log_f = open(run / "train_log.jsonl", "a")
    session = dict(started_step=meta["step"], args={**vars(args), "augment": args.augment and args.augment.to_json()},
                   start_time=time.strftime("%Y-%m-%d %H:%M:%S"),
                   device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    n_train = sum(p.numel() for g in groups for p in g["params"])
    print(f"training {n_train / 1e6:.2f} M parameters (lora rank {lora_rank}) from step {meta['step']} for at most "
          f"{total} steps or {args.minutes} min on {device}", flush=True)
    t0 = last_save = time.time()
    acc, n_acc, data_wait, next_index = defaultdict(float), 0, 0.0, meta["next_index"]

    def save() -> None:
        meta.update(step=step, next_index=next_index)
        tmp = run / "state.pt.tmp"
        torch.save(dict(trainable=trainable_state(model), optimizer=opt.state_dict(), meta=meta), tmp)
        os.replace(tmp, state_path)

    it = iter(loader)
    while step - first_step < total and time.time() - t0 < args.minutes * 60:
        progress.value = max((step - first_step) / total, (time.time() - t0) / (args.minutes * 60))
        tw = time.time()
        batch = next(it)
        data_wait += time.time() - tw
        next_index = max(next_index, int(batch["next_index"]))
        lr_scale = lr_at(step - first_step, progress.value, 1.0, args.warmup)
        for g in opt.param_groups:
            g["lr"] = g["peak"] * lr_scale
        feats = device_features(batch["windows"], extractor, device)
        if step == 0 and args.match_embedding_scale:
            match_embedding_scale(model, feats)
        with autocast:
            embeds = audio_embeddings(model, feats)
            x, rows, targets = sequence_batch(model, tokenizer, embeds, batch["n_windows"], batch["answers"],
                                              args.corrupt_inputs, np.random.default_rng([TRAIN_SEED + args.seed, step, 2]))
            loss, logs = answer_loss(model, x, rows, targets)
            if args.frame_loss:
                fl = frame_loss(model, embeds, batch["frame_targets"])
                loss = loss + args.frame_loss * fl
                logs["frame_ce"] = float(fl.detach())
        opt.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            print(f"step {step}: non-finite loss, skipped", flush=True)
            continue
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(proj_params + lora_params, 1.0)
        opt.step()
        step += 1
        for k, v in logs.items():
            acc[k] += v
        acc["grad_norm"] += float(gnorm)
        acc["audio_seconds"] += float(sum(batch["n_windows"])) * 30
        n_acc += 1
        if step % args.log_every == 0:
            rec = {k: (v / n_acc if k not in ("answer_tokens", "audio_seconds") else v) for k, v in acc.items()}
            rec.update(step=step, lr_scale=round(lr_scale, 4), seconds=round(meta["train_seconds"] + time.time() - t0, 1),
                       clip_seconds=list(stage_at(progress.value, stages)), data_wait=round(data_wait, 1),
                       lora_rank=lora_rank)
            for name, (hb, hf) in heldout.items():
                with autocast:
                    rec.update({f"{name}_{k}": v for k, v in heldout_loss(model, tokenizer, hb, hf).items()})
            write_log(log_f, rec)
            acc.clear()
            n_acc = 0
        if time.time() - last_save > args.save_minutes * 60:
            save()
            last_save = time.time()
    meta["train_seconds"] += time.time() - t0
    session.update(end_step=step, seconds=round(time.time() - t0, 1), data_wait=round(data_wait, 1))
    meta["sessions"].append(session)
    save()
    log_f.close()
    del it, loader


# --- evaluation (plain greedy generate, independent of the engine) -------------------------------------------
def load_run(run_dir: Path | None, trained_dir: Path | None, device, dtype: torch.dtype = torch.float32):
    """The assembled model with a run's trained state (merged LoRA) or a shipped trained folder."""
    if run_dir is not None:
        model, tokenizer, _ = assemble(None)
        state = torch.load(Path(run_dir) / "state.pt", map_location="cpu", weights_only=False)
        rank = state["meta"].get("lora_rank", 0)
        if rank:
            lora.attach(model.model.language_model, rank, float(state["trainable"]["lora_meta"]["alpha"]))
        load_trainable(model, state["trainable"])
        lora.merge(model.model.language_model)
    else:
        model, tokenizer, _ = assemble(trained_dir or TRAINED_DIR)
    return model.to(device=device, dtype=dtype).eval(), tokenizer


@torch.no_grad()
def greedy_transcribe(model, tokenizer, audios: list[np.ndarray], device, caps: list[int], batch_size: int = 16):
    """Greedy `generate()` transcripts and whether each ended with `<|im_end|>`; clips with the same number of
    30 s windows share a prompt length, so they are batched without padding."""
    from transformers import WhisperFeatureExtractor

    from wnw_exp.backbones.audio_windows import windowed_features

    fe = WhisperFeatureExtractor(feature_size=80)
    eos = model.generation_config.eos_token_id
    feats = [windowed_features(a, fe, device) for a in audios]
    out = [None] * len(audios)
    groups = defaultdict(list)
    for i, f in enumerate(feats):
        groups[f.shape[0]].append(i)
    for nw, idx in sorted(groups.items()):
        prompt = chat_prompt_ids(tokenizer, model.config.audio_token_id, nw * TOKENS_PER_WINDOW)
        for b in range(0, len(idx), batch_size):
            part = idx[b:b + batch_size]
            ids = torch.tensor([prompt] * len(part), device=device)
            gen = model.generate(input_ids=ids, input_features=torch.cat([feats[i] for i in part]).to(model.dtype),
                                 attention_mask=torch.ones_like(ids), max_new_tokens=max(caps[i] for i in part),
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos)
            for row, i in zip(gen[:, ids.shape[1]:].tolist(), part):
                row = row[: caps[i]]
                ended = eos in row
                row = row[: row.index(eos)] if ended else row
                out[i] = (tokenizer.decode(row, skip_special_tokens=True).strip(), ended)
    return out


def evaluate(model, tokenizer, device, n: int, split: str, min_seconds: float, max_seconds: float,
             predictions: Path | None = None) -> dict:
    """Greedy WER on `n` clips of `split`; with `predictions`, each group of clips (one batch of generate()) is
    appended to that file as it finishes, so a call cut short keeps what it decoded."""
    from wnw_exp.engine.decode import max_new_tokens_for
    from wnw_exp.metrics.text import corpus_wer

    t0 = time.time()
    ds = synthesised(n=n, split=split, min_seconds=min_seconds, max_seconds=max_seconds, text="natural")
    samples = list(ds)
    audios = [s.audio() for s in samples]
    t_synth = time.time() - t0
    caps = [max_new_tokens_for(len(a) / SAMPLE_RATE, 5.0, 24) for a in audios]
    if predictions is not None:
        Path(predictions).write_text("")
    groups = defaultdict(list)  # clips of one window count share a prompt length: one generate() batch
    for i, a in enumerate(audios):
        groups[max(1, math.ceil(len(a) / WINDOW_SAMPLES))].append(i)
    res: list = [None] * len(samples)
    for _, idx in sorted(groups.items()):
        for i, r in zip(idx, greedy_transcribe(model, tokenizer, [audios[i] for i in idx], device,
                                               [caps[i] for i in idx])):
            res[i] = r
        if predictions is not None:
            with open(predictions, "a") as f:
                for i in idx:
                    f.write(json.dumps(dict(id=samples[i].id, reference=samples[i].reference, hypothesis=res[i][0],
                                            terminated=res[i][1])) + "\n")
    pairs = [(s.reference, h) for s, (h, _) in zip(samples, res)]
    return dict(split=split, n=n, clip_seconds=[min_seconds, max_seconds], wer=round(corpus_wer(pairs), 3),
                terminated=sum(e for _, e in res), synth_s=round(t_synth, 1), decode_s=round(time.time() - t0 - t_synth, 1))


def eval_cmd(args: argparse.Namespace) -> None:
    device = _device(args.device)
    model, tokenizer = load_run(Path(args.run_dir) if args.run_dir else None,
                                Path(args.trained_dir) if args.trained_dir else None, device,
                                torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
    summary = evaluate(model, tokenizer, device, args.n, args.split, args.min_seconds, args.max_seconds,
                       Path(args.predictions) if args.predictions else None)
    if args.run_dir:
        summary["step"] = torch.load(Path(args.run_dir) / "state.pt", map_location="cpu", weights_only=False)["meta"]["step"]
        with open(Path(args.run_dir) / "eval_log.jsonl", "a") as f:
            f.write(json.dumps(summary) + "\n")
    print("eval", json.dumps(summary), flush=True)


def probe(args: argparse.Namespace) -> None:
    """Teacher-forced CE and token accuracy of a trained folder on dev clips of natural and of shuffled text."""
    from transformers import WhisperFeatureExtractor

    device = _device(args.device)
    model, tokenizer = load_run(None, Path(args.trained_dir) if args.trained_dir else None, device)
    extractor = WhisperFeatureExtractor(feature_size=80)
    sets = heldout_sets(tokenizer, extractor, device, args.n, split=args.split, min_seconds=args.min_seconds,
                        max_seconds=args.max_seconds)
    res = dict(split=args.split, n=args.n, clip_seconds=[args.min_seconds, args.max_seconds])
    for name, (batch, feats) in sets.items():
        res.update({f"{name}_{k}": round(v, 4) for k, v in heldout_loss(model, tokenizer, batch, feats).items()})
        if args.without_audio:  # the same answers after the features of silence: what the decoder guesses alone
            silent = device_features(torch.zeros_like(batch["windows"]), extractor, device)
            res.update({f"{name}_silence_{k}": round(v, 4)
                        for k, v in heldout_loss(model, tokenizer, batch, silent).items()})
    print("probe", json.dumps(res), flush=True)


def export(args: argparse.Namespace) -> None:
    """Write the run's projector (and LoRA) and its training record into a trained folder."""
    from safetensors.torch import save_file

    run, out = Path(args.run_dir), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = torch.load(run / "state.pt", map_location="cpu", weights_only=False)
    tr = state["trainable"]
    save_file({k: v.contiguous() for k, v in tr["projector"].items()}, str(out / "projector.safetensors"))
    if tr["lora"]:  # bfloat16 halves the file; the merge computes in float32
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tr["lora"].items()}, str(out / "lora.safetensors"),
                  metadata=tr["lora_meta"])
    elif (out / "lora.safetensors").exists():
        (out / "lora.safetensors").unlink()
    meta = {k: v for k, v in state["meta"].items()}
    (out / "training_meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    for name in ("train_log.jsonl", "eval_log.jsonl"):
        if (run / name).exists():
            (out / name).write_bytes((run / name).read_bytes())
    print(f"exported step {meta['step']} to {out}")


def _voices_arg(text: str):
    value = text if text in voice_sets.PRESET_NAMES else tuple(v.strip() for v in text.split(",") if v.strip())
    try:
        voice_sets.resolve(value, "en")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("dataset.voices", "--voices")) from None
    return value


def _pair_arg(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give MIN,MAX words per minute, e.g. 120,230") from None
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 < MIN <= MAX")
    return lo, hi


def _fraction_arg(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = -1.0
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a fraction in [0, 1], e.g. 0.3")
    return x


def _texts_arg(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in names if t not in TEXTS or t == "shuffled"]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: choose among {', '.join(t for t in TEXTS if t != 'shuffled')} "
                                          "(shuffled words: --shuffle-words)")
    return names


def _augment_arg(text: str):
    from wnw_exp.train.augment import parse

    try:
        return parse(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="wnw-train-projector", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train")
    t.add_argument("--run-dir", required=True)
    t.add_argument("--minutes", type=float, default=6.0)
    t.add_argument("--total-steps", type=int, default=2000, help="steps of this training run at most")
    t.add_argument("--batch-windows", type=int, default=32)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--lora-rank", type=int, default=0)
    t.add_argument("--lora-alpha", type=float, default=32.0)
    t.add_argument("--lora-lr", type=float, default=2e-4)
    t.add_argument("--stages", default=None, help="JSON [[fraction, min_s, max_s], ...]")
    t.add_argument("--match-embedding-scale", type=int, default=1, help="1: rescale a fresh projector's output")
    t.add_argument("--frame-loss", type=float, default=0.0, help="weight of the frame loss (0: off)")
    t.add_argument("--shuffle-words", type=float, default=0.0,
                   help="fraction of the training clips that speak their sentences' words in a random order")
    t.add_argument("--corrupt-inputs", type=float, default=0.0,
                   help="share of the teacher-forced answer inputs replaced by another token of the answer (0: off)")
    t.add_argument("--heldout", type=int, default=8,
                   help="dev clips (natural, and shuffled words) whose teacher-forced CE each log line has (0: none)")
    t.add_argument("--voices", default="six", type=_voices_arg,
                   help=f"a voice preset ({', '.join(voice_sets.PRESET_NAMES)}) or comma-separated voice names")
    t.add_argument("--rate-range", default=None, type=_pair_arg,
                   help="MIN,MAX words per minute (default: the preset's)")
    t.add_argument("--six-share", default=0.0, type=_fraction_arg,
                   help="fraction of the clips spoken by the six voices at 150-200 wpm whatever --voices says (0: none)")
    t.add_argument("--texts", default=("natural",), type=_texts_arg,
                   help="comma-separated text domains drawn per clip (natural, kjv, random)")
    t.add_argument("--augment", default=None, type=_augment_arg,
                   help="off, light (speed 0.9-1.1, gain +-6 dB, reverb p 0.3, noise p 0.5 at 15-40 dB SNR) or a JSON "
                        "object of wnw_exp.train.augment.Augment fields")
    t.add_argument("--init-from", default=None, help="a trained folder (projector.safetensors, lora.safetensors) "
                                                     "to start a fresh run from")
    t.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="auto")
    t.add_argument("--log-every", type=int, default=20)
    t.add_argument("--save-minutes", type=float, default=2.0)
    def clips(parser, n: int, min_s: float, max_s: float):
        """The weights and the clips an eval or a probe runs on."""
        parser.add_argument("--trained-dir", default=None)
        parser.add_argument("--n", type=int, default=n)
        parser.add_argument("--split", default="dev")
        parser.add_argument("--min-seconds", type=float, default=min_s)
        parser.add_argument("--max-seconds", type=float, default=max_s)
        parser.add_argument("--device", default="auto")
        return parser

    e = clips(sub.add_parser("eval"), 20, 120.0, 240.0)
    e.add_argument("--run-dir", default=None)
    e.add_argument("--predictions", default=None)
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    pr = clips(sub.add_parser("probe", help="teacher-forced CE/accuracy on dev clips of natural and of shuffled text"),
               4, 20.0, 40.0)
    pr.add_argument("--without-audio", action="store_true",
                    help="also with the audio replaced by silence (the decoder's guess from the prompt alone)")
    x = sub.add_parser("export")
    x.add_argument("--run-dir", required=True)
    x.add_argument("--out", default=str(TRAINED_DIR))
    args = ap.parse_args(argv)
    {"train": train, "eval": eval_cmd, "probe": probe, "export": export}[args.command](args)


if __name__ == "__main__":
    main()
