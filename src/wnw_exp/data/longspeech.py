"""LongSpeech (Yang et al. 2026): French ASR (`asr-fr`) and English-to-French translation (`en2fr`).

The benchmark's release layout could not be confirmed when this was written, so both subsets are
read from a JSONL (or CSV) manifest in the format of `wnw_exp.data.manifest`:

    {"id": "...", "audio": "clips/xyz.wav", "reference": "...", "language": "fr", "task": "transcribe"}
    {"id": "...", "audio": "clips/abc.wav", "reference": "<French translation>", "language": "en",
     "task": "translate", "target_language": "fr"}

`audio` is relative to the manifest's folder (or absolute); missing language/task fields take the
subset's defaults below. Per §3.2, 200 clips are sub-sampled from each subset with a fixed seed
(`n=200`, `seed=0`); `en2fr` is scored with sacreBLEU against `reference`.
"""

from __future__ import annotations

import os

from .dataset import SampleList
from .manifest import manifest

SUBSETS = {
    "longspeech_asr_fr": dict(split="asr-fr", language="fr", task="transcribe", target_language=None,
                              env="WNW_LONGSPEECH_ASR_FR"),
    "longspeech_en2fr": dict(split="en2fr", language="en", task="translate", target_language="fr",
                             env="WNW_LONGSPEECH_EN2FR"),
}  # fmt: skip


def longspeech(
    name: str,
    path: str | os.PathLike | None = None,
    n: int | None = 200,
    seed: int = 0,
    shard: int = 0,
    num_shards: int = 1,
    split: str | None = None,
) -> SampleList:
    """The subset `name` of SUBSETS; `split` only renames it (default: asr-fr / en2fr)."""
    subset = SUBSETS[name]
    path = path or os.environ.get(subset["env"])
    if not path:
        raise ValueError(
            f"{name}: dataset.path is not set: write a JSONL manifest of the LongSpeech {subset['split']} clips "
            f"(fields audio, reference; see wnw_exp/data/longspeech.py) and set dataset.path=<file> or {subset['env']}"
        )
    return manifest(
        path,
        language=subset["language"],
        task=subset["task"],
        target_language=subset["target_language"],
        n=n,
        seed=seed,
        shard=shard,
        num_shards=num_shards,
        name=name,
        split=split or subset["split"],
    )
