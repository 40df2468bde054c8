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
    """12 hex digits of the SHA-256 over the names and content digests of `trained_files(model)` (None: not ours).
    Each file's digest is cached by path, size and mtime (`paths.file_digest`): an unchanged file is read once."""
    from wnw_exp.paths import file_digest

    files = trained_files(model)
    if files is None:
        return None
    if not files:  # assembling fails later with its own message; the identity says that nothing was found
        return "missing"
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{file_digest(f)}\n".encode())
    return h.hexdigest()[:12]
