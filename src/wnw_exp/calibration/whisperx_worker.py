"""WhisperX forced alignment of reference transcripts, run inside WhisperX's own environment.

    python whisperx_worker.py MANIFEST.jsonl OUT_DIR [--device cpu|cuda] [--align-model NAME]

This file imports only the standard library, numpy and whisperx, so it runs from a separate virtual
environment that has nothing but `pip install whisperx` (whisperx pins torch~=2.8 and older
transformers, which would break this package's environment). `wnw-align` writes the manifest (one JSON
object per line: id, audio = path of a 16 kHz mono 16-bit WAV, reference, language, duration, out =
file name) and calls this script with that environment's python; each sample's result is written to
OUT_DIR/<out> in WhisperX's own output format (`segments`, `word_segments`), with the sample id,
reference, language and aligner version beside it. Samples whose file exists are skipped (resumable).

Each reference is aligned as one segment spanning the whole recording (forced alignment of known
text: no Whisper transcription, no VAD).
"""

from __future__ import annotations

import argparse
import json
import sys
import wave
from pathlib import Path


def read_wav(path: str):
    import numpy as np

    with wave.open(path, "rb") as f:
        if f.getnchannels() != 1 or f.getsampwidth() != 2 or f.getframerate() != 16000:
            raise ValueError(f"{path}: expected 16 kHz mono 16-bit PCM")
        data = f.readframes(f.getnframes())
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("manifest")
    ap.add_argument("out_dir")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--align-model", default=None)
    args = ap.parse_args(argv)
    try:
        import whisperx
    except ImportError as e:
        print(f"whisperx is not importable from {sys.executable} ({e}). Create its own environment: "
              "python -m venv ~/.venvs/whisperx && ~/.venvs/whisperx/bin/pip install whisperx", file=sys.stderr)
        return 2
    version = getattr(whisperx, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as _v

            version = _v("whisperx")
        except Exception:  # noqa: BLE001 - the version is informative only
            version = None
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    models: dict[str, tuple] = {}
    items = [json.loads(line) for line in Path(args.manifest).read_text().splitlines() if line.strip()]
    done = 0
    for item in items:
        target = out_dir / item["out"]
        if target.exists():
            continue
        lang = item.get("language") or "en"
        if lang not in models:
            models[lang] = whisperx.load_align_model(language_code=lang, device=args.device,
                                                     model_name=args.align_model)
        model, meta = models[lang]
        audio = read_wav(item["audio"])
        segments = [{"text": item["reference"], "start": 0.0, "end": len(audio) / 16000.0}]
        result = whisperx.align(segments, model, meta, audio, args.device, return_char_alignments=False)
        record = dict(id=item["id"], reference=item["reference"], language=lang,
                      aligner=dict(name="whisperx", version=version, align_model=args.align_model),
                      segments=result["segments"], word_segments=result["word_segments"])
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, default=float) + "\n")
        tmp.replace(target)
        done += 1
        print(f"aligned {item['id']} ({len(result['word_segments'])} words)", flush=True)
    print(f"{done} aligned, {len(items) - done} already there", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
