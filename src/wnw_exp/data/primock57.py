"""PriMock57 (Papadopoulos Korfiatis et al. 2022): 57 mock primary-care consultations.

Layout of https://github.com/babylonhealth/primock57 (audio in Git LFS: `git lfs pull`):

    <root>/audio/day<D>_consultation<NN>_doctor.wav      16 kHz 16-bit mono, one file per speaker
    <root>/audio/day<D>_consultation<NN>_patient.wav
    <root>/transcripts/day<D>_consultation<NN>_doctor.TextGrid    utterance intervals, one tier
    <root>/transcripts/day<D>_consultation<NN>_patient.TextGrid

One sample per consultation, id `day<D>_consultation<NN>`, ordered by (day, consultation).
Audio: the two channels averaged (each scaled by 1/2, as the corpus's `scripts/mix_audio.sh` does
with `sox -m`), which cannot clip. Reference: the non-empty intervals of both TextGrids (every
tier) merged by start time (doctor first on ties), the corpus's tags `<UNSURE>`, `</UNSURE>`,
`<UNIN/>`, `<INAUDIBLE_SPEECH/>` removed (the words inside <UNSURE> are kept, as the corpus's
`strip_transcript_tags` does), whitespace collapsed, no speaker prefixes, utterances joined by a
space; case and punctuation are kept (metrics normalise).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from .audio import load_mix, safe_duration
from .base import Sample
from .dataset import SampleList, resolve_root, select

ENV = "WNW_PRIMOCK57"
SPEAKERS = ("doctor", "patient")
_NAME = re.compile(r"^day(\d+)_consultation(\d+)_doctor\.wav$")
_TAGS = re.compile(r"</?UNSURE>|<UNIN/>|<INAUDIBLE_SPEECH/>")
_FIX = "clone https://github.com/babylonhealth/primock57 (with `git lfs pull` for the audio) so that <root>/audio and <root>/transcripts exist"


@dataclass(frozen=True)
class _Entry:
    id: str
    audio: tuple[Path, Path]
    transcripts: tuple[Path, Path]
    reference: str = ""


def strip_tags(text: str) -> str:
    """Remove PriMock57's transcription tags and collapse whitespace."""
    return re.sub(r"\s+", " ", _TAGS.sub("", text)).strip()


def utterances(textgrid_path: str | os.PathLike) -> list[tuple[float, float, str]]:
    """(start, end, text) of every non-empty interval of every tier, tags removed."""
    from praatio import textgrid

    tg = textgrid.openTextgrid(str(textgrid_path), includeEmptyIntervals=False)
    out = []
    for tier_name in tg.tierNames:
        for start, end, label in tg.getTier(tier_name).entries:
            text = strip_tags(label)
            if text:
                out.append((float(start), float(end), text))
    return out


def merged_reference(doctor_textgrid: str | os.PathLike, patient_textgrid: str | os.PathLike) -> str:
    """Both speakers' utterances in time order (doctor first on equal start times), joined by spaces."""
    timed = [(start, rank, text) for rank, path in enumerate((doctor_textgrid, patient_textgrid))
             for start, _, text in utterances(path)]  # fmt: skip
    return " ".join(text for _, _, text in sorted(timed, key=lambda t: (t[0], t[1])))


def entries(root: str | os.PathLike | None) -> list[_Entry]:
    base = resolve_root(root, ENV, "PriMock57", _FIX)
    audio_dir, transcript_dir = base / "audio", base / "transcripts"
    if not audio_dir.is_dir() or not transcript_dir.is_dir():
        raise FileNotFoundError(f"PriMock57 root {base} has no audio/ and transcripts/ folders: {_FIX}")
    found = []
    for doctor in audio_dir.glob("day*_consultation*_doctor.wav"):
        match = _NAME.match(doctor.name)
        if not match:
            continue
        stem = doctor.name[: -len("_doctor.wav")]
        audio = tuple(audio_dir / f"{stem}_{s}.wav" for s in SPEAKERS)
        grids = tuple(transcript_dir / f"{stem}_{s}.TextGrid" for s in SPEAKERS)
        for p in (*audio, *grids):
            if not p.exists():
                raise FileNotFoundError(f"PriMock57 file missing: {p} (each consultation has doctor and patient audio and TextGrids)")
        found.append(((int(match[1]), int(match[2])), _Entry(stem, audio, grids)))
    if not found:
        raise FileNotFoundError(f"no day*_consultation*_doctor.wav under {audio_dir}: {_FIX}")
    return [e for _, e in sorted(found, key=lambda kv: kv[0])]


def _sample(entry: _Entry) -> Sample:
    return Sample(
        id=entry.id,
        load_audio=partial(load_mix, entry.audio),
        duration=safe_duration(*entry.audio),
        reference=entry.reference,
        language="en",
    )


def primock57(
    root: str | os.PathLike | None = None,
    n: int | None = None,
    seed: int = 0,
    shard: int = 0,
    num_shards: int = 1,
    name: str = "primock57",
    split: str = "all",
) -> SampleList:
    chosen = select(entries(root), n, seed, shard, num_shards)
    with_references = []
    for e in chosen:  # transcripts are parsed here, so a broken TextGrid fails the build, naming it
        try:
            reference = merged_reference(*e.transcripts)
        except Exception as err:
            raise ValueError(f"cannot read PriMock57 transcripts {e.transcripts[0].name}/{e.transcripts[1].name}: {err}") from err
        with_references.append(replace(e, reference=reference))
    return SampleList(name=name, split=split, entries=with_references, make=_sample)
