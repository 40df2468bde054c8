"""Bring-your-own data: a JSONL or CSV/TSV manifest of audio paths and references.

One record per line (JSONL) or row (CSV with a header; TSV if the file ends in .tsv):

    audio            path of the audio file, absolute or relative to the manifest's folder
                     (aliases: audio_path, audio_filepath, path, wav, file)
    reference        the reference text: transcript, or translation when task is "translate"
                     (aliases: text, transcript, sentence, translation, target)
    id               optional; default: the audio file's stem (ids must be unique)
    language         optional source language; default `language` of the config ("en")
    task             optional "transcribe" | "translate"; default `task` of the config
    target_language  optional, for translation; default `target_language` of the config
    duration         optional seconds; default read from the audio header

Records keep the file's order; `n`/`seed` sub-sample and `shard`/`num_shards` split as everywhere.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from .audio import load_audio, safe_duration
from .base import Sample
from .dataset import SampleList, select

AUDIO_KEYS = ("audio", "audio_path", "audio_filepath", "path", "wav", "file")
REFERENCE_KEYS = ("reference", "text", "transcript", "sentence", "translation", "target")
TASKS = ("transcribe", "translate")


@dataclass(frozen=True)
class _Entry:
    id: str
    audio: Path
    reference: str
    language: str
    task: str
    target_language: str | None
    duration: float | None


def read_records(path: Path) -> list[dict]:
    """The manifest's records as dicts (JSONL, or CSV/TSV with a header row)."""
    if path.suffix.lower() in (".csv", ".tsv"):
        with path.open(newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ","))
    records = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no}: not a JSON object ({e})") from e
    return records


def _field(record: dict, keys: tuple[str, ...], where: str, required: bool = True):
    for k in keys:
        if record.get(k) not in (None, ""):
            return record[k]
    if required:
        raise ValueError(f"{where}: no {keys[0]!r} field (accepted names: {', '.join(keys)})")
    return None


def entries(
    path: str | os.PathLike,
    language: str = "en",
    task: str = "transcribe",
    target_language: str | None = None,
) -> list[_Entry]:
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"manifest not found at {path}: set dataset.path to a JSONL or CSV file of audio, reference")
    out = []
    for i, record in enumerate(read_records(path)):
        where = f"{path} record {i + 1}"
        audio = Path(str(_field(record, AUDIO_KEYS, where))).expanduser()
        if not audio.is_absolute():
            audio = path.parent / audio
        rec_task = record.get("task") or task
        if rec_task not in TASKS:
            raise ValueError(f"{where}: task must be one of {TASKS}, got {rec_task!r}")
        duration = record.get("duration")
        out.append(
            _Entry(
                id=str(record.get("id") or audio.stem),
                audio=audio,
                reference=str(_field(record, REFERENCE_KEYS, where)).strip(),
                language=record.get("language") or language,
                task=rec_task,
                target_language=record.get("target_language") or target_language,
                duration=float(duration) if duration not in (None, "") else None,
            )
        )
    seen: dict[str, int] = {}
    for e in out:
        seen[e.id] = seen.get(e.id, 0) + 1
    duplicates = [k for k, c in seen.items() if c > 1]
    if duplicates:
        raise ValueError(f"{path}: duplicate sample ids {duplicates[:5]}: add a unique 'id' field to each record")
    return out


def _sample(entry: _Entry) -> Sample:
    return Sample(
        id=entry.id,
        load_audio=partial(load_audio, entry.audio),
        duration=entry.duration if entry.duration is not None else safe_duration(entry.audio),
        reference=entry.reference,
        language=entry.language,
        task=entry.task,
        target_language=entry.target_language,
    )


def manifest(
    path: str | os.PathLike | None = None,
    language: str = "en",
    task: str = "transcribe",
    target_language: str | None = None,
    n: int | None = None,
    seed: int = 0,
    shard: int = 0,
    num_shards: int = 1,
    name: str = "manifest",
    split: str | None = None,
) -> SampleList:
    """A data set from a manifest file; `split` defaults to the manifest's file stem."""
    if not path:
        raise ValueError("dataset.path is not set: point it at a JSONL or CSV manifest of audio, reference")
    chosen = select(entries(path, language, task, target_language), n, seed, shard, num_shards)
    return SampleList(name=name, split=split or Path(path).stem, entries=chosen, make=_sample)
