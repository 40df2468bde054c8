"""Where wnw-exp finds its configuration and keeps what it caches. The bottom layer: it imports nothing of the
project, so every other layer (data, backbones, the CLI) may ask it without an import going upwards."""

from __future__ import annotations

import os
from pathlib import Path


def conf_dir() -> Path:
    """The Hydra config groups: `$WNW_CONF`, or the conf/ that ships inside the package (so a plain
    `pip install .` finds it as well as an editable one)."""
    return Path(os.environ.get("WNW_CONF") or Path(__file__).resolve().parent / "conf")


def cache_root() -> Path:
    """`$WNW_CACHE` or `~/.cache/wnw_exp`: synthetic clips, converted pretrained weights, espeak-ng's library."""
    return Path(os.environ.get("WNW_CACHE") or Path.home() / ".cache" / "wnw_exp")
