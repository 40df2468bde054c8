"""Audio files -> float32 mono 16 kHz, streamed.

Files are read in blocks with soundfile (FLAC, WAV and whatever libsndfile reads), each block is
mixed to mono and fed to soxr's streaming resampler, and the result is written into one output
array: a four-minute file never exists in memory at its native rate or as a second full copy.
Any failure to read a file surfaces as `AudioLoadError` naming the file, raised lazily from
`Sample.load_audio`, so the runner can record it as a failed sample and go on.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import soundfile as sf
import soxr

from .base import SAMPLE_RATE

BLOCK_SECONDS = 30.0


class AudioLoadError(RuntimeError):
    """An audio file that cannot be opened or decoded."""


def audio_duration(path: str | Path) -> float:
    """Duration in seconds from the file header (no decoding)."""
    try:
        info = sf.info(str(path))
    except Exception as e:  # soundfile raises LibsndfileError/RuntimeError/OSError variously
        raise AudioLoadError(f"cannot read audio header of {path}: {e}") from e
    return info.frames / info.samplerate


def safe_duration(*paths: str | Path) -> float:
    """The longest duration of `paths`, or NaN if a header is unreadable (the load will then fail)."""
    try:
        return max(audio_duration(p) for p in paths)
    except AudioLoadError:
        return float("nan")


def load_audio(path: str | Path, *, sample_rate: int = SAMPLE_RATE, block_seconds: float = BLOCK_SECONDS) -> np.ndarray:
    """float32 mono audio of `path` at `sample_rate`."""
    return load_mix([path], sample_rate=sample_rate, block_seconds=block_seconds)


def load_mix(
    paths: Sequence[str | Path], *, sample_rate: int = SAMPLE_RATE, block_seconds: float = BLOCK_SECONDS
) -> np.ndarray:
    """The average of several recordings (e.g. one channel per speaker), float32 mono at `sample_rate`.

    Averaging (each input scaled by 1/len(paths), as `sox -m` does) cannot clip; shorter inputs
    count as silence after their end.
    """
    if not paths:
        raise ValueError("load_mix needs at least one path")
    out = np.zeros(0, np.float32)
    length = 0
    for path in paths:
        try:
            out, n = _accumulate(out, path, 1.0 / len(paths), sample_rate, block_seconds)
        except AudioLoadError:
            raise
        except Exception as e:
            raise AudioLoadError(f"cannot decode audio {path}: {e}") from e
        length = max(length, n)
    return out[:length]


def _accumulate(out: np.ndarray, path, gain: float, sample_rate: int, block_seconds: float) -> tuple[np.ndarray, int]:
    """Add `gain` x the mono, resampled audio of `path` into `out` (grown as needed).

    Returns `out` and the number of output samples this file produced.
    """
    try:
        f = sf.SoundFile(str(path))
    except Exception as e:
        raise AudioLoadError(f"cannot open audio {path}: {e}") from e
    with f:
        rate = f.samplerate
        expected = math.ceil(f.frames * sample_rate / rate) if f.frames > 0 else 0
        if len(out) < expected:
            out = np.concatenate([out, np.zeros(expected - len(out), np.float32)])
        stream = None if rate == sample_rate else soxr.ResampleStream(rate, sample_rate, 1, dtype="float32", quality="HQ")
        pos = 0
        block = max(1, int(block_seconds * rate))
        while True:
            data = f.read(block, dtype="float32", always_2d=True)
            last = len(data) < block
            mono = data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0]
            chunk = mono if stream is None else stream.resample_chunk(mono, last=last)
            if pos + len(chunk) > len(out):
                out = np.concatenate([out, np.zeros(pos + len(chunk) - len(out), np.float32)])
            out[pos : pos + len(chunk)] += gain * chunk
            pos += len(chunk)
            if last:
                break
    return out, pos
