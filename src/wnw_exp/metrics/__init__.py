"""Pure metric functions: truncated WER/BLEU (§3.5) and attention-mismatch statistics (§2.1)."""

from wnw_exp.metrics.mismatch import (
    cumulative,
    expected_random_jaccard,
    mass_fractions,
    random_jaccard_baseline,
    resample_to_grid,
    topk_jaccard,
)
from wnw_exp.metrics.text import (
    WerCounts,
    corpus_bleu,
    corpus_wer,
    corpus_wer_counts,
    normalize,
    sample_wer,
    truncate,
    wer_counts,
)

__all__ = [
    "WerCounts",
    "corpus_bleu",
    "corpus_wer",
    "corpus_wer_counts",
    "cumulative",
    "expected_random_jaccard",
    "mass_fractions",
    "normalize",
    "random_jaccard_baseline",
    "resample_to_grid",
    "sample_wer",
    "topk_jaccard",
    "truncate",
    "wer_counts",
]
