"""Training-time audio augmentation (`wnw-train-projector train --augment light`): off by default.

Per training clip, with its own generator (`numpy.random.default_rng([seed, clip index, 3])`, so a clip is
augmented the same way in every run and worker):

    speed    tempo and pitch together (Kaldi-style speed perturbation): the clip resampled by soxr (VHQ) as if
             recorded at `factor` x 16 kHz; word times are divided by the factor
    gain     loudness, dB uniform in the range (pedalboard `Gain`)
    reverb   with probability `reverb_p`, a light room (pedalboard `Reverb`, Freeverb: room size 0.1-0.5, wet
             0.05-0.25, dry 1 - wet, damping 0.5)
    noise    with probability `noise_p`, white Gaussian noise at an SNR uniform in the range (dB, against the
             clip's RMS)

The result is clipped to [-1, 1] and rounded to the int16 grid, as the training windows are. pedalboard
(Spotify, GPL-3.0, numpy only) is an optional dependency: `pip install -e '.[augment]'`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

import numpy as np
import soxr

from wnw_exp.data.base import SAMPLE_RATE, Word


@dataclass(frozen=True)
class Augment:
    speed: tuple[float, float] = (0.9, 1.1)
    gain_db: tuple[float, float] = (-6.0, 6.0)
    reverb_p: float = 0.3
    noise_p: float = 0.5
    noise_snr_db: tuple[float, float] = (15.0, 40.0)

    def __post_init__(self) -> None:
        for name in ("speed", "gain_db", "noise_snr_db"):
            lo, hi = getattr(self, name)
            if not lo <= hi:
                raise ValueError(f"augment {name}={[lo, hi]}: need min <= max")
        if not 0 < self.speed[0]:
            raise ValueError(f"augment speed={list(self.speed)}: factors must be > 0")
        for name in ("reverb_p", "noise_p"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"augment {name}={getattr(self, name)}: a probability in [0, 1]")

    def to_json(self) -> dict:
        return asdict(self)


RECIPES = {"light": Augment()}


def parse(spec: str | None) -> Augment | None:
    """`--augment`: off (None), a recipe name (light), or a JSON object of `Augment` fields over `light`."""
    if spec in (None, "", "off", "none"):
        return None
    if spec in RECIPES:
        aug = RECIPES[spec]
    else:
        try:
            given = json.loads(spec)
        except json.JSONDecodeError:
            given = None
        names = {f.name for f in fields(Augment)}
        if not isinstance(given, dict) or set(given) - names:
            raise ValueError(f"--augment {spec!r}: give off, {', '.join(RECIPES)} or a JSON object of "
                             f"{', '.join(sorted(names))}")
        aug = Augment(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})
    try:
        import pedalboard  # noqa: F401  (checked here: a training run fails before its workers start)
    except ImportError:
        raise ValueError("--augment needs pedalboard: pip install -e '.[augment]'") from None
    return aug


def augment(audio: np.ndarray, words: list[Word], aug: Augment, rng: np.random.Generator
            ) -> tuple[np.ndarray, list[Word]]:
    """The augmented 16 kHz float32 clip and its words with their times moved by the speed change."""
    try:
        from pedalboard import Gain, Pedalboard, Reverb
    except ImportError:
        raise RuntimeError("--augment needs pedalboard: pip install -e '.[augment]'") from None

    factor = float(rng.uniform(*aug.speed))
    gain = float(rng.uniform(*aug.gain_db))
    reverb = rng.random() < aug.reverb_p
    room, wet = float(rng.uniform(0.1, 0.5)), float(rng.uniform(0.05, 0.25))
    noisy = rng.random() < aug.noise_p
    snr = float(rng.uniform(*aug.noise_snr_db))
    x = audio.astype(np.float32)
    if factor != 1.0:
        x = soxr.resample(x, SAMPLE_RATE * factor, SAMPLE_RATE, quality="VHQ").astype(np.float32)
        duration = len(x) / SAMPLE_RATE
        words = [Word(w.text, round(w.start / factor, 4), min(round(w.end / factor, 4), duration)) for w in words]
    board = [Gain(gain_db=gain)] + ([Reverb(room_size=room, wet_level=wet, dry_level=1.0 - wet, damping=0.5)]
                                    if reverb else [])
    x = Pedalboard(board)(x, SAMPLE_RATE)
    if noisy:
        rms = float(np.sqrt(np.mean(x.astype(np.float64) ** 2))) or 1e-4
        x = x + rng.standard_normal(len(x)).astype(np.float32) * np.float32(rms / 10 ** (snr / 20))
    x = np.clip(np.round(np.clip(x, -1.0, 1.0) * 32768.0), -32768, 32767).astype(np.float32) / np.float32(32768.0)
    return x, words
