"""Whisper-style log-mel features in 30 s windows, the way Voxtral's processor feeds its encoder."""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers import WhisperFeatureExtractor

from wnw_exp.data.base import SAMPLE_RATE


def n_windows(n_samples: int, window_seconds: float = 30.0) -> int:
    return max(1, math.ceil(n_samples / (window_seconds * SAMPLE_RATE)))


def windowed_features(
    audio: np.ndarray, extractor: WhisperFeatureExtractor, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """(n_windows, n_mels, 3000) log-mel features; the last window is zero-padded to 30 s.

    Each window is normalised on its own, exactly as Voxtral's processor does when it splits a long
    recording into 30 s chunks.
    """
    win = int(extractor.chunk_length * SAMPLE_RATE)
    chunks = [audio[i : i + win] for i in range(0, max(len(audio), 1), win)]
    feats = extractor(
        chunks,
        sampling_rate=SAMPLE_RATE,
        padding="max_length",
        return_tensors="pt",
        return_attention_mask=False,
        device=str(device),
    ).input_features
    return feats.to(device)
