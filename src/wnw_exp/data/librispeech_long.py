"""LibriSpeech-Long (Park et al. 2025): LibriSpeech dev/test re-cut into recordings of up to 4 minutes.

Download https://storage.googleapis.com/librispeech_long/v0_1.tar.gz (linked from
https://github.com/google-deepmind/librispeech-long) and unpack it. Layout (confirmed from a public
recipe that reads the tarball; the repository's README documents only the download):

    librispeech-long/<split>/<speaker>/<chapter>/<chapter>_<segment>.flac
    librispeech-long/<split>/<speaker>/<chapter>/<chapter>_<segment>.txt   (one line, no newline)

with <split> in dev-clean, dev-other, test-clean, test-other and <segment> zero-padded to 4 digits.
`root` may be the `librispeech-long` folder itself or the folder it was unpacked in.
Sample ids follow LibriSpeech: `<speaker>-<chapter>-<segment>`, e.g. `1272-128104-0000`; samples
are ordered by (speaker, chapter, segment) numerically. Transcripts are kept as released
(upper case, no punctuation); metrics normalise.

Calibration (§3.2): split=dev-clean, n=50, seed=0 gives the 50 calibration samples, drawn by
`select` with a fixed seed; they cannot overlap test-clean/test-other (different LibriSpeech
speakers and folders).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from .audio import load_audio, safe_duration
from .base import Sample
from .dataset import SampleList, resolve_root, select

SPLITS = ("dev-clean", "dev-other", "test-clean", "test-other")
CALIBRATION = {"split": "dev-clean", "n": 50, "seed": 0}
ENV = "WNW_LIBRISPEECH_LONG"
DOWNLOAD = "https://storage.googleapis.com/librispeech_long/v0_1.tar.gz"


@dataclass(frozen=True)
class _Entry:
    id: str
    audio: Path
    reference: str


def _fix(root: Path | str) -> str:
    return (
        f"download the tarball {DOWNLOAD} (see https://github.com/google-deepmind/librispeech-long) "
        f"and unpack it so that {root}/test-clean/<speaker>/<chapter>/<chapter>_<segment>.flac exists"
    )


def split_dir(root: str | os.PathLike | None, split: str) -> Path:
    """The folder of `split`, accepting the unpacked `librispeech-long` folder or its parent."""
    if split not in SPLITS:
        raise ValueError(f"LibriSpeech-Long split must be one of {', '.join(SPLITS)}; got {split!r}")
    base = resolve_root(root, ENV, "LibriSpeech-Long", _fix(root or "<root>"))
    for candidate in (base / split, base / "librispeech-long" / split):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"LibriSpeech-Long split {split!r} not found under {base}: {_fix(base)}, or set dataset.root=... / {ENV}"
    )


def entries(root: str | os.PathLike | None, split: str) -> list[_Entry]:
    """Every recording of `split`, in (speaker, chapter, segment) order."""
    folder = split_dir(root, split)
    found = []
    for flac in folder.glob("*/*/*.flac"):
        speaker, chapter = flac.parent.parent.name, flac.parent.name
        chapter_of_file, _, segment = flac.stem.partition("_")
        if chapter_of_file != chapter or not segment:
            raise ValueError(f"unexpected LibriSpeech-Long file name {flac} (want <chapter>_<segment>.flac)")
        txt = flac.with_suffix(".txt")
        if not txt.exists():
            raise FileNotFoundError(f"LibriSpeech-Long transcript missing: {txt} (the tarball has one .txt per .flac)")
        key = (int(speaker), int(chapter), int(segment))
        found.append((key, _Entry(f"{speaker}-{chapter}-{segment}", flac, txt.read_text(encoding="utf-8").strip())))
    if not found:
        raise FileNotFoundError(f"no <speaker>/<chapter>/*.flac under {folder}: {_fix(folder.parent)}")
    return [e for _, e in sorted(found, key=lambda kv: kv[0])]


def _sample(entry: _Entry) -> Sample:
    return Sample(
        id=entry.id,
        load_audio=partial(load_audio, entry.audio),
        duration=safe_duration(entry.audio),
        reference=entry.reference,
        language="en",
    )


def librispeech_long(
    root: str | os.PathLike | None = None,
    split: str = "test-clean",
    n: int | None = None,
    seed: int = 0,
    shard: int = 0,
    num_shards: int = 1,
    name: str = "librispeech_long",
) -> SampleList:
    chosen = select(entries(root, split), n, seed, shard, num_shards)
    return SampleList(name=name, split=split, entries=chosen, make=_sample)
