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


def device_features(windows: torch.Tensor, extractor: WhisperFeatureExtractor, device: torch.device) -> torch.Tensor:
    """`windowed_features` of whole 30 s windows (int16 samples, (n, 480000)) computed on `device`: the same
    arithmetic as `WhisperFeatureExtractor` (STFT, mel filter bank, log10, the per-window floor at max - 8,
    then (x + 4) / 4) without its round trips through numpy (the trainers' data path)."""
    audio = windows.to(device, non_blocking=True).float() / 32768.0
    window = torch.hann_window(extractor.n_fft, device=device)
    stft = torch.stft(audio, extractor.n_fft, extractor.hop_length, window=window, return_complex=True)
    magnitudes = (stft[..., :-1].abs() ** 2).contiguous()
    mel = torch.from_numpy(extractor.mel_filters).to(device, torch.float32).T @ magnitudes
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.amax(dim=(1, 2), keepdim=True) - 8.0)
    return (log_spec + 4.0) / 4.0
