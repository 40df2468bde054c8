"""The one sample type every data set yields and every later stage reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

SAMPLE_RATE = 16_000


@dataclass(frozen=True)
class Word:
    """One word of the reference with its time span in seconds (from espeak or an aligner)."""

    text: str
    start: float
    end: float


@dataclass
class Sample:
    """A recording and its reference.

    `load_audio` returns float32 mono audio at 16 kHz; it is called lazily so a data set of
    hundreds of long recordings holds none of them in memory until a sample is run.
    """

    id: str
    load_audio: Callable[[], np.ndarray] = field(repr=False)
    duration: float
    reference: str
    language: str = "en"
    task: str = "transcribe"  # "transcribe" | "translate"
    target_language: str | None = None  # for task == "translate"
    words: list[Word] | None = field(default=None, repr=False)

    def audio(self) -> np.ndarray:
        return self.load_audio()
