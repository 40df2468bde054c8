"""Which trained weights a model config runs with, as a fingerprint for the run identity (no torch import).

The embedded model's trained weights ship inside the package (`whisper_smollm2`'s projector and LoRA in
whisper_smollm2/, or `model.trained_dir`) and change when they are trained further, while
their config does not. `weights_fingerprint` hashes those files, so that a run directory never holds samples of
two weight versions: new weights give a new `cfg-<hash>` (rundir.identity). Hub models and `model.path` folders
are the user's (their paths are in the config already; hashing gigabytes at every start is not worth it), and
models built from a seed have none: both give None, which leaves their identity as it was.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).parent / "backbones"
WHISPER_SMOLLM2_DIR = HERE / "whisper_smollm2"  # the trained projector (+ LoRA) and its record


def trained_files(model: dict) -> list[Path] | None:
    """The weight files a model config loads from the package or `model.trained_dir`, else None."""
    if model.get("random"):
        return None
    if model.get("parts") == "whisper_smollm2" and not model.get("path"):
        folder = Path(model["trained_dir"]) if model.get("trained_dir") else WHISPER_SMOLLM2_DIR
    else:
        return None
    return sorted(folder.glob("*.safetensors"))


def weights_fingerprint(model: dict) -> str | None:
    """12 hex digits of the SHA-256 over the names and bytes of `trained_files(model)` (None: not ours)."""
    files = trained_files(model)
    if files is None:
        return None
    if not files:  # assembling fails later with its own message; the identity says that nothing was found
        return "missing"
    return _digest(tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))


@lru_cache(maxsize=16)
def _digest(stats: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for name, _, _ in stats:  # keyed on size and mtime so an unchanged file is hashed once per process
        h.update(Path(name).name.encode())
        with open(name, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()[:12]
