"""Where wnw-exp finds its configuration and keeps what it caches. The bottom layer: it imports nothing of the
project, so every other layer (data, backbones, the CLI) may ask it without an import going upwards."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def conf_dir() -> Path:
    """The Hydra config groups: `$WNW_CONF`, or the conf/ that ships inside the package (so a plain
    `pip install .` finds it as well as an editable one)."""
    return Path(os.environ.get("WNW_CONF") or Path(__file__).resolve().parent / "conf")


def cache_root() -> Path:
    """`$WNW_CACHE` or `~/.cache/wnw_exp`: synthetic clips, converted pretrained weights, espeak-ng's library."""
    return Path(os.environ.get("WNW_CACHE") or Path.home() / ".cache" / "wnw_exp")


def shipped_head_scores(model_name: str) -> Path:
    """The head-score file shipped for `model_name` (`method.head_scores` unset): calibration/shipped/<name>.json."""
    return Path(__file__).resolve().parent / "calibration" / "shipped" / f"{model_name}.json"


_DIGESTS: dict[tuple[str, int, int], str] = {}  # this process's file digests by (path, size, mtime)


def file_digest(path: Path) -> str:
    """16 hex digits of the SHA-256 of a file's bytes. Fast path: a file whose (absolute path, size, mtime) was
    hashed before, by this process or another one (cached under `$WNW_CACHE/file-digests/`), is not read again;
    an edit changes its size or mtime, so its bytes are hashed anew."""
    path = Path(path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _DIGESTS:
        return _DIGESTS[key]
    cached = cache_root() / "file-digests" / hashlib.sha256(repr(key).encode()).hexdigest()[:32]
    try:
        digest = cached.read_text().strip()
    except OSError:
        digest = ""
    if len(digest) != 16:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        digest = h.hexdigest()[:16]
        try:  # a cache that cannot be written only costs the next run the hashing
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(digest + "\n")
            os.replace(tmp, cached)
        except OSError:
            pass
    _DIGESTS[key] = digest
    return digest
