"""Bring-your-own data: a JSONL or CSV/TSV manifest of audio paths and references.

One record per line (JSONL) or row (CSV with a header; TSV if the file ends in .tsv):

    audio            path of the audio file, absolute or relative to the manifest's folder
                     (aliases: audio_path, audio_filepath, path, wav, file)
    reference        the reference text: transcript, or translation when task is "translate"
                     (aliases: text, transcript, sentence, translation, target)
    id               optional; default: the audio file's stem (ids must be unique)
    language         optional source language; default `language` of the config ("en")
    task             optional "transcribe" (aliases asr, transcription) | "translate" (ast, st, translation);
                     default `task` of the config
    target_language  optional, for translation; default `target_language` of the config
    duration         accepted and not used: the audio file's header decides how long a recording is

The file is UTF-8 (a BOM is allowed). Records keep the file's order; `n`/`seed` sub-sample and
`shard`/`num_shards` split as everywhere.
"""

from __future__ import annotations

import csv
import io
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
TASKS = {"transcribe": "transcribe", "asr": "transcribe", "transcription": "transcribe",
         "translate": "translate", "ast": "translate", "st": "translate", "translation": "translate"}


@dataclass(frozen=True)
class _Entry:
    id: str
    audio: Path
    reference: str
    language: str
    task: str
    target_language: str | None


def read_records(path: Path) -> list[dict]:
    """The manifest's records as dicts (JSONL, or CSV/TSV with a header row)."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line_no = raw[: e.start].count(b"\n") + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"{path}:{line_no}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {column}): "
                         "save the manifest as UTF-8") from None
    if path.suffix.lower() in (".csv", ".tsv"):
        return list(csv.DictReader(io.StringIO(text, newline=""), delimiter="\t" if path.suffix.lower() == ".tsv" else ","))
    records = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                if not line.lstrip().startswith("["):
                    raise ValueError(f"{path}:{line_no}: not a JSON object ({e}): a manifest is JSONL, one JSON "
                                     "object per line") from None
                record = []  # an indented JSON array: named as one below
            if not isinstance(record, dict):
                what = "a JSON array" if isinstance(record, list) else f"{line.strip()[:20]!r}"
                raise ValueError(f"{path}:{line_no}: {what}, not a JSON object: a manifest is JSONL, one JSON object "
                                 "per line")
            records.append(record)
    return records


def _task(value: str, where: str) -> str:
    task = TASKS.get(str(value).strip().lower())
    if task is None:
        raise ValueError(f"{where}: task must be transcribe (or asr, transcription) or translate (or ast, st, "
                         f"translation), got {value!r}")
    return task


def _field(record: dict, keys: tuple[str, ...], where: str):
    for k in keys:
        if record.get(k) is not None and str(record[k]).strip():
            return record[k]
    given = [k for k in keys if k in record]
    if given:
        raise ValueError(f"{where}: the {given[0]!r} field is empty")
    raise ValueError(f"{where}: no {keys[0]!r} field (accepted names: {', '.join(keys)})")


def entries(
    path: str | os.PathLike,
    language: str = "en",
    task: str = "transcribe",
    target_language: str | None = None,
) -> list[_Entry]:
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"manifest not found at {path}: set dataset.path to a JSONL or CSV file of audio, reference")
    task = _task(task, "dataset.task")
    out = []
    for i, record in enumerate(read_records(path)):
        where = f"{path} record {i + 1}"
        audio = Path(str(_field(record, AUDIO_KEYS, where))).expanduser()
        if not audio.is_absolute():
            audio = path.parent / audio
        out.append(
            _Entry(
                id=str(record.get("id") or audio.stem),
                audio=audio,
                reference=str(_field(record, REFERENCE_KEYS, where)).strip(),
                language=record.get("language") or language,
                task=_task(record["task"], where) if record.get("task") else task,
                target_language=record.get("target_language") or target_language,
            )
        )
    if not out:
        raise ValueError(f"{path} holds no records: write one JSON object (audio, reference) per line")
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
        duration=safe_duration(entry.audio),  # the header, never the manifest: it decides what gets decoded
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
