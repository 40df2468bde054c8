"""Natural English text for the synthetic speech of `dataset=synthetic dataset.text=natural`.

Source: passages written by SmolLM2-135M-Instruct (Apache-2.0; the decoder of `model=whisper_smollm2`) from fixed
prompts (written by `wnw_exp.train.natural_text`), sampled once with a fixed seed on one H200 on 2026-12-01 (`python
-m wnw_exp.train.natural_text generate --device cuda --batch-size 512`, torch 2.11, transformers 5.17: 3,696
passages in 131 s; then, at 16:22 UTC, `... --splits train` after the train samples per prompt went from 3 to 6:
2,976 more train passages in about 100 s, appended, the earlier lines unchanged; another device or torch build
samples other text) and shipped as `natural_text/passages.jsonl.gz` (3.1 MB; train 742k words, test 42k, calib 42k,
dev 9k): an offline source with a clear licence, since nothing may be downloaded. The prompts combine a subject with
a form ("a news report about ...", "a letter to a friend about ..."); the subjects are split between test, dev,
calib and train (`SPLIT_OF_SUBJECT`), so no test, dev or calibration text is ever trained on, not even a passage on
the same subject.

Clean-up (`sentences`, a pure function of the raw text): markdown and list lines are dropped, the text
is split into sentences, and a sentence is kept only if it is 3-40 words of letters with the
punctuation , . ; : ! ? ' - (no digits, quotes, brackets or symbols: espeak-ng would read them in ways
a transcript cannot score), with no ellipsis and no word without a letter; repeated sentences within a passage are dropped (a small LM loops).
"""

from __future__ import annotations

import gzip
import json
import re
from functools import lru_cache
from pathlib import Path

CORPUS = Path(__file__).parent / "natural_text" / "passages.jsonl.gz"

SUBJECTS = (
    # test (20)
    "a lighthouse keeper", "the history of bread", "how bees communicate", "a night train across the mountains",
    "an old clockmaker", "learning to swim", "a flooded village", "the first day at a new school",
    "a lost dog finding its way home", "how volcanoes form", "a small bakery in the city", "a winter storm",
    "the life of a river", "a market in the morning", "an astronaut's journey", "a grandmother's garden",
    "the invention of the telephone", "a football match in the rain", "a forest fire", "a village festival",
    # dev (10)
    "a fishing boat at dawn", "how trees grow", "a museum at night", "a broken bicycle", "the moon landing",
    "a busy hospital", "a summer camp", "the history of paper", "a desert caravan", "a street musician",
    # calib (20)
    "a mountain rescue", "how clouds form", "an island far away", "a young painter", "the history of the bicycle",
    "a family dinner", "a snowy morning", "a train station", "the life of an ant colony", "a chess tournament",
    "an old castle", "a rainy afternoon", "how a ship is built", "a farmer's year", "the ocean floor",
    "a school play", "a library", "a thunderstorm", "a kite festival", "a long walk in the countryside",
    # train (the rest)
    "a dragon who cannot fly", "how electricity works", "a cooking competition", "a lost wallet",
    "the history of writing", "a city park", "a robot learning to paint", "a journey by canoe", "a tiny mouse",
    "the solar system", "a birthday party", "an ancient library", "how rain is made", "a cat on a roof",
    "the history of music", "a detective and a missing ring", "a farmers market", "a hot air balloon",
    "a small town newspaper", "a pilot in a storm", "the life of a butterfly", "how glass is made",
    "a wedding in the village", "a haunted house", "the first snow of the year", "a ferry crossing",
    "a science fair", "a young inventor", "the history of maps", "a bear in the forest", "a quiet beach",
    "a runaway horse", "how the heart works", "a mail carrier", "a jazz club", "the life of a tree",
    "a camping trip", "a friendly giant", "how coffee is grown", "a rescue at sea", "a lonely robot",
    "the history of trains", "a garden in spring", "a baker and a king", "the Arctic", "a pirate ship",
    "a hospital nurse", "how a bridge is built", "a talking parrot", "an old photograph", "a city at night",
    "the history of medicine", "a wolf pack", "a flower shop", "a mountain village", "the rainforest",
    "a clever fox", "a shipwreck", "how plants drink water", "a violin maker", "a windy day",
    "the history of money", "a bus driver", "a magic lamp", "a zoo keeper", "the life of a whale",
    "a long winter", "how honey is made", "a soldier coming home", "a fairy in the woods", "a bookshop",
    "the history of the Olympic games", "a road trip", "a carpenter", "a comet", "a girl who could talk to birds",
    "a piano lesson", "how mountains are made", "a busy airport", "a sleepy dragon", "an underwater city",
    "the history of cheese", "a knight and a princess", "a coal miner", "a frozen lake", "a spaceship crew",
    "a children's hospital", "how bread rises", "a market in the desert", "a secret tunnel", "a thunderbird",
    "the history of the printing press", "a family of owls", "a restaurant kitchen", "a storm at sea",
    "a little red boat", "how the brain learns", "an autumn forest", "a carnival", "a lost island",
    "the history of glass", "a gardener and a rose", "a monkey in the jungle", "a country doctor",
    "a sunrise over the hills", "how cheese is made", "a giant turtle", "a brave little mouse", "a weather report",
    "the history of chocolate", "a teacher's last day", "a dolphin", "a tailor", "a stormy night",
    "how airplanes fly", "an old sailor", "a busy harbour", "the history of the calendar", "a snowman",
    "a magician", "a train robbery", "a farm in summer", "the life of a honeybee", "a potter",
)
SPLITS = {"test": range(0, 20), "dev": range(20, 30), "calib": range(30, 50), "train": range(50, len(SUBJECTS))}
SPLIT_OF_SUBJECT = {SUBJECTS[i]: split for split, r in SPLITS.items() for i in r}

_ALLOWED = re.compile(r"^[A-Za-z ,.;:!?'\-]+$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_HAS_LETTER = re.compile(r"[A-Za-z]")


def sentences(text: str) -> list[str]:
    """The clean sentences of one passage (see the module docstring), in order."""
    lines = [ln.strip() for ln in text.replace("\u2019", "'").splitlines()]
    prose = " ".join(ln for ln in lines if ln and not re.match(r"^([#*\-\d]|>|\|)", ln))
    out, seen = [], set()
    for s in _SENTENCE_END.split(prose):
        s = " ".join(s.split())
        if not s or s[-1] not in ".!?" or not _ALLOWED.match(s) or not 3 <= len(s.split()) <= 40:
            continue
        if ".." in s or any(not _HAS_LETTER.search(w) for w in s.split()):  # ellipses, a lone "-"
            continue
        if s.lower() in seen:
            continue
        seen.add(s.lower())
        out.append(s)
    return out


@lru_cache(maxsize=None)
def split_sentences(split: str, corpus: str = str(CORPUS)) -> tuple[tuple[str, ...], ...]:
    """Per passage of `split`, in file order, its clean sentences (passages with none are skipped)."""
    if split not in SPLITS:
        raise ValueError(f"natural-text split must be one of {sorted(SPLITS)}, got {split!r}")
    path = Path(corpus)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: it ships with wnw-exp (regenerate it with "
                                "`python -m wnw_exp.train.natural_text generate`)")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec["split"] == split:
                s = sentences(rec["text"])
                if s:
                    out.append(tuple(s))
    if not out:
        raise ValueError(f"{path} holds no {split!r} passages")
    return tuple(out)
