"""Paired bootstrap of a corpus-WER difference: is method A's truncated WER really above or below method B's?

Both methods decoded the same clips. A resample draws n clips with replacement from those n (the same draw for A
and B: the pairing), and its statistic is the *corpus* WER of A minus that of B on the drawn clips, each corpus WER
being 100 * (sum of errors) / (sum of reference words) as `metrics.text.corpus_wer` computes it, never a mean of
per-clip WERs. Since both methods share the references, the difference is 100 * sum(e_A - e_B) / sum(ref words)
over the drawn clips. The interval is the percentile interval of that statistic over the resamples; the point
value is the difference on the clips as they are.

The draw is seeded (numpy's PCG64), so a report built twice shows the same intervals. Numpy only: the report side
imports this without any model stack.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_RESAMPLES = 10_000
DEFAULT_SEED = 0


@dataclass(frozen=True)
class PairedDiff:
    """Corpus WER of A minus B (percentage points) and its bootstrap percentile interval."""

    diff: float
    low: float
    high: float
    n_clips: int
    confidence: float
    n_resamples: int
    seed: int

    @property
    def excludes_zero(self) -> bool:
        """The interval lies wholly above or wholly below 0: the difference is significant at this level."""
        return self.low > 0 or self.high < 0


def paired_bootstrap_wer(errors_a, errors_b, ref_words, *, n_resamples: int = DEFAULT_RESAMPLES,
                         seed: int = DEFAULT_SEED, confidence: float = 0.95) -> PairedDiff:
    """Corpus truncated WER of A minus B over paired clips, with its `confidence` percentile interval.

    `errors_a`, `errors_b`: per clip edit counts (substitutions + deletions + insertions, `WerCounts.errors`) of
    the two methods, in the same clip order; `ref_words`: per clip reference words (`WerCounts.ref_words`).
    Clips are resampled with replacement, `n_resamples` times, from numpy's `default_rng(seed)`: resample b is
    row b of `rng.integers(0, n, size=(n_resamples, n))`.
    """
    ea, eb, ref = (np.asarray(x, dtype=np.float64) for x in (errors_a, errors_b, ref_words))
    if not (ea.ndim == eb.ndim == ref.ndim == 1) or not (len(ea) == len(eb) == len(ref)):
        raise ValueError(f"paired bootstrap: errors_a, errors_b and ref_words must be 1-D and of one length, got "
                         f"{ea.shape}, {eb.shape}, {ref.shape}")
    n = len(ref)
    if n == 0:
        raise ValueError("paired bootstrap: no clips to resample (the two runs share no scored sample)")
    if (ref < 0).any() or (ea < 0).any() or (eb < 0).any():
        raise ValueError("paired bootstrap: error and reference-word counts must be >= 0")
    if ref.sum() == 0:
        raise ValueError("paired bootstrap: the clips have no reference words; WER is undefined")
    if not 0 < confidence < 1:
        raise ValueError(f"paired bootstrap: confidence must be in (0, 1), got {confidence}")
    if n_resamples < 1:
        raise ValueError(f"paired bootstrap: n_resamples must be >= 1, got {n_resamples}")
    d = ea - eb
    point = 100.0 * d.sum() / ref.sum()
    rng = np.random.default_rng(seed)
    stats = np.empty(n_resamples)
    block = max(1, 2_000_000 // n)  # rows of indices per draw: memory stays bounded for large corpora
    for start in range(0, n_resamples, block):
        rows = min(block, n_resamples - start)
        idx = rng.integers(0, n, size=(rows, n))
        words = ref[idx].sum(axis=1)
        # a resample of only clips without reference words has no WER; with one clip of words it always has
        with np.errstate(invalid="ignore", divide="ignore"):
            stats[start:start + rows] = 100.0 * d[idx].sum(axis=1) / words
    stats = stats[np.isfinite(stats)]
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(stats, [tail, 100.0 - tail])
    return PairedDiff(float(point), float(low), float(high), n, confidence, n_resamples, seed)
