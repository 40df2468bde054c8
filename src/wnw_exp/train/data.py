"""Training batches for the tiny model, synthesised on the fly by the `synthetic` data set's generator.

A worker process synthesises a *source* clip with `synthesize_clip` (the training split's seeds, the
fixed training voices) and cuts it into training clips at word boundaries, so one espeak call feeds
several clips: short ones while the curriculum is short, one or two long crops of a 4-minute source
later (three overlapping crops per source). Every clip is packed with everything the losses need (see `model.training_losses`):

- the audio as whole 30 s windows (int16, the last one zero-padded, exactly like
  `audio_windows.windowed_features` cuts it), turned into log-mel features on the device;
- the token ids `transcription_prompt(375 * n_windows) + words` and the answer rows/targets
  (`words + </s>`);
- per audio token (80 ms): the word it lies in (`<pad>` in silence, `</s>` after the last word) and the
  word before it; per answer row, the span of audio tokens of the word it must emit.

The curriculum (`CURRICULUM`) is a list of stages by optimizer step; workers read the current step
from a shared counter, so the clip lengths follow the training run, also after a resume.
"""

from __future__ import annotations

import math
import multiprocessing as mp
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from wnw_exp.backbones.word_tokenizer import BOS, EOS, PAD, transcription_prompt
from wnw_exp.data.base import SAMPLE_RATE
from wnw_exp.data.synthetic import DEFAULT_VOICES, SPLIT_SEED_BASE, synthesize_clip

from .model import AUDIO_TOKENS_PER_WINDOW

WINDOW_SAMPLES = 30 * SAMPLE_RATE
TOKEN_SECONDS = 30.0 / AUDIO_TOKENS_PER_WINDOW  # 0.08 s: 12.5 audio tokens per second
AUDIO_OFFSET = 3  # <s>[INST][BEGIN_AUDIO] precede the audio tokens
TRAIN_VOICES = DEFAULT_VOICES["en"]  # the fixed list of training voices (the test split uses them too)
TRAIN_SEED = SPLIT_SEED_BASE["train"]


@dataclass(frozen=True)
class Stage:
    """Clips of min_seconds..max_seconds until optimizer step `until`; `windows` 30 s windows per batch."""

    until: int
    min_seconds: float
    max_seconds: float
    windows: int


CURRICULUM: tuple[Stage, ...] = (
    Stage(300, 1.0, 8.0, 64),
    Stage(700, 4.0, 30.0, 64),
    Stage(1200, 20.0, 90.0, 64),
    Stage(1800, 60.0, 180.0, 48),
    Stage(10**9, 110.0, 240.0, 48),
)


def stage_at(step: int, curriculum: tuple[Stage, ...] = CURRICULUM) -> Stage:
    return next(s for s in curriculum if step < s.until)


# --- cutting a source clip into training clips --------------------------------------------------


def crop(audio: np.ndarray, words: list, a: int, b: int, rng: np.random.Generator) -> tuple[np.ndarray, list]:
    """Words a..b-1 of a source clip with a little of the silence around them (never a neighbour's audio)."""
    prev_end = words[a - 1].end if a > 0 else 0.0
    next_start = words[b].start if b < len(words) else len(audio) / SAMPLE_RATE
    start = max(prev_end, words[a].start - rng.uniform(0.0, 0.3))
    end = min(next_start, words[b - 1].end + 0.1)
    s0, s1 = int(round(start * SAMPLE_RATE)), int(round(end * SAMPLE_RATE))
    return audio[s0:s1], [(w.text, w.start - start, w.end - start) for w in words[a:b]]


def cut_clips(audio, words, min_s, max_s, rng, max_clips) -> list[tuple[np.ndarray, list]]:
    """Training clips of about min_s..max_s seconds from one source clip, at word boundaries."""
    out = []
    if max_s >= 60.0:  # long clips: random crops (they may overlap) of a long source
        for _ in range(max_clips):
            target = rng.uniform(min_s, max_s)
            ends = np.array([w.end for w in words])
            last_start = int(np.searchsorted(ends, ends[-1] - target))
            a = int(rng.integers(0, max(1, last_start) + 1)) if last_start > 0 else 0
            a = min(a, len(words) - 1)
            b = int(np.searchsorted(ends, words[a].start + target, side="right"))
            b = max(a + 1, min(b, len(words)))
            out.append(crop(audio, words, a, b, rng))
        return out
    a = 0
    while a < len(words) and len(out) < max_clips:  # short clips: consecutive pieces
        target = rng.uniform(min_s, max_s)
        b = a + 1
        while b < len(words) and words[b].end - words[a].start <= target:
            b += 1
        out.append(crop(audio, words, a, b, rng))
        a = b
    return out


# --- packing clips into a batch -----------------------------------------------------------------


def pack_batch(clips: list[tuple[np.ndarray, list]], word_ids: dict[str, int]) -> dict[str, torch.Tensor]:
    """Pad and label a list of (audio float32 16 kHz, [(word, start, end), ...]) clips."""
    windows, frame_cur, frame_prev, seqs, rows, targets, spans = [], [], [], [], [], [], []
    for audio, words in clips:
        nw = max(1, math.ceil(len(audio) / WINDOW_SAMPLES))
        padded = np.zeros(nw * WINDOW_SAMPLES, np.int16)
        padded[: len(audio)] = np.round(audio * 32768.0).clip(-32768, 32767).astype(np.int16)
        windows.append(padded.reshape(nw, WINDOW_SAMPLES))
        n_tok = nw * AUDIO_TOKENS_PER_WINDOW
        ids = [word_ids[w] for w, _, _ in words]
        starts = np.array([s for _, s, _ in words])
        ends = np.array([e for _, _, e in words])
        centers = (np.arange(n_tok) + 0.5) * TOKEN_SECONDS
        # word index holding each token centre (-1: none)
        k = np.searchsorted(starts, centers, side="right") - 1
        inside = (k >= 0) & (centers < ends[np.clip(k, 0, None)])
        cur = np.full(n_tok, PAD, np.int64)
        cur[inside] = np.array(ids)[k[inside]]
        cur[centers >= ends[-1]] = EOS
        prev = np.full(n_tok, -100, np.int64)
        prev_ids = np.array([BOS] + ids[:-1])
        prev[inside] = prev_ids[k[inside]]
        prev[centers >= ends[-1]] = ids[-1]  # after the last word: it is the word before `</s>`
        frame_cur.append(cur)
        frame_prev.append(prev)
        # audio-token span of each word (tokens whose centre lies in it; at least the one at its middle)
        first = np.ceil(starts / TOKEN_SECONDS - 0.5).astype(np.int64)
        last = np.ceil(ends / TOKEN_SECONDS - 0.5).astype(np.int64)
        mid = np.floor((starts + ends) / 2 / TOKEN_SECONDS).astype(np.int64)
        empty = last <= first
        first[empty], last[empty] = mid[empty], mid[empty] + 1
        eos_first = min(int(np.ceil(ends[-1] / TOKEN_SECONDS - 0.5)), n_tok - 1)
        sp = np.stack([np.append(first, eos_first), np.append(last, n_tok)], 1).clip(0, n_tok) + AUDIO_OFFSET
        prompt = transcription_prompt(n_tok)
        seqs.append(prompt + ids)
        rows.append(np.arange(len(ids) + 1) + len(prompt) - 1)
        targets.append(np.array(ids + [EOS]))
        spans.append(sp)
    B, T, R = len(clips), max(map(len, seqs)), max(map(len, rows))
    batch = {
        "windows": torch.from_numpy(np.concatenate(windows)),
        "ids": torch.full((B, T), PAD, dtype=torch.long),
        "answer_rows": torch.zeros((B, R), dtype=torch.long),
        "answer_targets": torch.full((B, R), -100, dtype=torch.long),
        "spans": torch.zeros((B, R, 2), dtype=torch.long),
        "frame_cur": torch.from_numpy(np.concatenate(frame_cur)),
        "frame_prev": torch.from_numpy(np.concatenate(frame_prev)),
    }
    for i in range(B):
        batch["ids"][i, : len(seqs[i])] = torch.tensor(seqs[i])
        r = len(rows[i])
        batch["answer_rows"][i, :r] = torch.from_numpy(rows[i])
        batch["answer_targets"][i, :r] = torch.from_numpy(targets[i])
        batch["spans"][i, :r] = torch.from_numpy(spans[i])
    batch["n_words"] = torch.tensor(sum(len(w) for _, w in clips))
    batch["audio_seconds"] = torch.tensor(sum(len(a) for a, _ in clips) / SAMPLE_RATE)
    return batch


# --- the stream ---------------------------------------------------------------------------------


class SyntheticBatches(IterableDataset):
    """An endless stream of packed batches; worker w of a run synthesises source clips
    `synthesize_clip(TRAIN_SEED + seed, index)` with index = w, w + n_workers, ... from `first_index`.

    `step` is a shared counter (multiprocessing.Value) that the training loop updates; it selects the
    curriculum stage of the clips a worker cuts next.
    """

    def __init__(self, vocab: list[str], seed: int, first_index: int, step: "mp.Value", vocab_size: int,
                 curriculum: tuple[Stage, ...] = CURRICULUM, voices: tuple[str, ...] = TRAIN_VOICES):  # fmt: skip
        self.word_ids = {w: i for i, w in enumerate(vocab)}
        self.seed, self.first_index, self.step = seed, first_index, step
        self.vocab_size, self.curriculum, self.voices = vocab_size, curriculum, voices

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        index = self.first_index + wid
        pending: list = []
        while True:
            stage = stage_at(self.step.value, self.curriculum)
            budget = stage.windows
            batch, used = [], 0
            while True:
                if not pending:
                    src_s = max(60.0, stage.max_seconds)
                    try:
                        audio, words = synthesize_clip(
                            TRAIN_SEED + self.seed, index, vocab_size=self.vocab_size, voices=self.voices,
                            min_seconds=src_s, max_seconds=src_s,
                        )  # fmt: skip
                    except RuntimeError:  # a rare espeak word-event failure: skip that source clip
                        index += nw
                        continue
                    rng = np.random.default_rng([self.seed, index, 7])
                    index += nw
                    n_long = 3 if stage.max_seconds >= 60.0 else 10**6
                    pending = cut_clips(audio, words, stage.min_seconds, stage.max_seconds, rng, n_long)
                    pending = [c for c in pending if c[1]]
                    continue
                need = max(1, math.ceil(len(pending[-1][0]) / WINDOW_SAMPLES))
                if used + need > budget and batch:
                    break
                batch.append(pending.pop())
                used += need
            out = pack_batch(batch, self.word_ids)
            out["next_index"] = torch.tensor(index)
            yield out
