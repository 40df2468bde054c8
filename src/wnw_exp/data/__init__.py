"""Data sets -> lazy `Sample`s. `build_dataset(cfg)` maps a `conf/dataset/<name>.yaml` to a reader.

Every data set takes `n` (null = all), `seed` (sub-sampling), `shard`/`num_shards` (sample i of
the selection goes to shard i % num_shards), and returns an object with `len()`, iteration and
indexing over Samples, `.ids` (the selected samples' ids, without building them), plus `.name` and
`.split` for run-directory naming. Selecting no sample is an error naming why.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Callable

from .base import SAMPLE_RATE, Sample, Word
from .librispeech_long import librispeech_long
from .longspeech import longspeech
from .manifest import manifest
from .primock57 import primock57
from .synthetic import SyntheticDataset

READERS: dict[str, Callable[..., Any]] = {
    "synthetic": SyntheticDataset,
    "librispeech_long": librispeech_long,
    "longspeech_asr_fr": partial(longspeech, "longspeech_asr_fr"),
    "longspeech_en2fr": partial(longspeech, "longspeech_en2fr"),
    "primock57": primock57,
    "manifest": manifest,
}


def build_dataset(cfg: Mapping[str, Any]):
    """The data set named by `cfg["name"]`, with the other keys as its options.

    `cfg` is a plain dict or an OmegaConf DictConfig (e.g. `cfg.dataset`). Unknown keys are an
    error naming the accepted ones, so a typo in an override never passes silently.
    """
    if hasattr(cfg, "_metadata"):  # DictConfig: resolve interpolations such as ${oc.env:...}
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(cfg, resolve=True)
    options = dict(cfg)
    name = options.pop("name", None)
    if name not in READERS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(READERS)}")
    reader = READERS[name]
    try:
        return reader(**options)
    except TypeError as e:
        if "unexpected keyword" in str(e):
            raise ValueError(f"dataset {name}: {e}") from e
        raise


__all__ = ["SAMPLE_RATE", "Sample", "Word", "READERS", "build_dataset"]
