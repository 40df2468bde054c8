"""What every reader returns: an ordered, sub-sampled, sharded list of lazy Samples."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import numpy as np

from .base import Sample

T = TypeVar("T")


def select(items: Sequence[T], n: int | None = None, seed: int = 0, shard: int = 0, num_shards: int = 1) -> list[T]:
    """Sub-sample then shard, keeping corpus order.

    `n` items are drawn without replacement by `numpy.random.default_rng(seed)` (all of them when
    `n` is None or not smaller than the corpus); the same (corpus, n, seed) always gives the same
    subset. Of those, item i (in corpus order) belongs to shard i % num_shards. A selection of nothing
    is a ValueError naming why: a run of zero samples would only look like a result.
    """
    if not 0 <= shard < num_shards:
        raise ValueError(f"dataset.shard={shard} is outside 0..{num_shards - 1} (dataset.num_shards={num_shards})")
    if n is not None and n < 1:
        raise ValueError(f"dataset.n={n} selects no sample: use n >= 1, or n=null for all")
    if len(items) == 0:
        raise ValueError("the data set holds no samples")
    indices = np.arange(len(items))
    if n is not None and n < len(items):
        indices = np.sort(np.random.default_rng(seed).choice(len(items), size=n, replace=False))
    chosen = [items[i] for i in indices[shard::num_shards]]
    if not chosen:
        raise ValueError(f"dataset.shard={shard} selects no sample: {len(indices)} samples make fewer than "
                         f"dataset.num_shards={num_shards} shards")
    return chosen


@dataclass
class SampleList:
    """A data set: `name` and `split` name the run directory; iterate or index for Samples.

    Samples are built on access from `entries` by `make` (cheap: header reads only), so building
    the data set never opens audio payloads.
    """

    name: str
    split: str
    entries: list
    make: Callable[[object], Sample]

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def ids(self) -> list[str]:
        """The selected samples' ids, in order, without building the samples."""
        return [e.id for e in self.entries]

    def __getitem__(self, i: int) -> Sample:
        return self.make(self.entries[i])

    def __iter__(self) -> Iterator[Sample]:
        return (self.make(e) for e in self.entries)


def resolve_root(root: str | os.PathLike | None, env: str, what: str, fix: str) -> Path:
    """`root`, else `$env`; a missing one is a ValueError/FileNotFoundError naming `fix`."""
    value = root if root not in (None, "") else os.environ.get(env)
    if not value:
        raise ValueError(f"{what} root is not set: {fix}, then set dataset.root=<dir> or the environment variable {env}")
    path = Path(value).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{what} root not found at {path}: {fix}, or set dataset.root=<dir> / {env}")
    return path
