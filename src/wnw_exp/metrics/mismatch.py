"""Prefill/decode attention-mismatch statistics of the paper's §2.1 (Figure 1).

Inputs are per-audio-position attention vectors (prefill: first answer token; decode-cumulative:
averaged over all answer tokens), already averaged over layers and heads by the caller. All
functions are numpy-only so the report side can use them on saved traces.

Positions are placed on the audio's time axis: position ``i`` of ``T`` covers ``[i/T, (i+1)/T)``.
"First 10% of the audio" and the grid of Figure 1a are read on that axis, and a position that
straddles a boundary contributes the overlapping part of its mass (so T need not be a multiple of
10, and curves of different T average cleanly).
"""

from __future__ import annotations

import math

import numpy as np


def _distribution(p: np.ndarray) -> np.ndarray:
    """1-D float copy of ``p`` scaled to sum 1; rejects negative, empty or all-zero input."""
    p = np.asarray(p, dtype=np.float64).reshape(-1)
    if p.size == 0:
        raise ValueError("empty attention vector")
    if np.any(p < 0) or not np.all(np.isfinite(p)):
        raise ValueError("attention weights must be finite and non-negative")
    total = p.sum()
    if total <= 0:
        raise ValueError("attention vector has no mass")
    return p / total


def cumulative(p: np.ndarray) -> np.ndarray:
    """Cumulative mass ``c[i]`` = share of attention on positions ``0..i`` (``c[-1] == 1``)."""
    return np.cumsum(_distribution(p))


def _mass_before(p: np.ndarray, x: np.ndarray | float) -> np.ndarray:
    """Mass on audio time ``[0, x)``, ``x`` in [0, 1]; each position's mass spreads evenly."""
    p = _distribution(p)
    edges = np.linspace(0.0, 1.0, p.size + 1)
    return np.interp(x, edges, np.concatenate(([0.0], np.cumsum(p))))


def mass_fractions(p: np.ndarray) -> dict[str, float]:
    """Share of attention on the first 10%, first half and second half of the audio (§2.1).

    The paper's numbers: prefill 47.9% / 69.3% (first 10% / first half), decode-cumulative
    9.8% and 47.7% / 52.3%. ``p`` is normalised here, so raw summed scores are fine.
    """
    first10, first_half = _mass_before(p, np.array([0.1, 0.5]))
    return {
        "first10": float(first10),
        "first_half": float(first_half),
        "second_half": float(1.0 - first_half),
    }


def resample_to_grid(p: np.ndarray, n_bins: int) -> np.ndarray:
    """Mass of ``p`` on ``n_bins`` equal slices of the audio (sums to 1), for Figure 1a.

    Samples have different token counts T; averaging needs a common axis. Each output bin gets the
    exact mass of the positions (and position fractions) it overlaps, so total mass is preserved
    and a uniform ``p`` maps to a uniform grid whatever T and n_bins are.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    return np.diff(_mass_before(p, np.linspace(0.0, 1.0, n_bins + 1)))


def _topk_indices(scores: np.ndarray, k: int) -> set[int]:
    # Stable sort on the negated scores: ties go to the earlier position, deterministically.
    return set(np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")[:k].tolist())


def topk_jaccard(a: np.ndarray, b: np.ndarray, k: int) -> float:
    """|A ∩ B| / |A ∪ B| of the top-``k`` positions of two score vectors over the same audio.

    ``k`` is clipped to the number of positions (then the answer is 1: both sets are everything).
    Ties are broken toward earlier positions, identically for both vectors.
    """
    a = np.asarray(a).reshape(-1)
    b = np.asarray(b).reshape(-1)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"need two non-empty vectors of one length, got {a.size} and {b.size}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    k = min(k, a.size)
    top_a, top_b = _topk_indices(a, k), _topk_indices(b, k)
    return len(top_a & top_b) / len(top_a | top_b)


def random_jaccard_baseline(k: int, T: int) -> float:
    """The paper's random baseline ``K / T_a`` (0.013 at K=100), with K clipped to T.

    Strictly this is the expected *overlap fraction* |A ∩ B| / K of two random K-subsets, not their
    expected Jaccard, which is about half of it when K << T (|A ∪ B| ≈ 2K); see
    ``expected_random_jaccard`` for the exact value. Kept because it is the number the paper quotes.
    """
    if k < 1 or T < 1:
        raise ValueError(f"k and T must be >= 1, got k={k}, T={T}")
    return min(k, T) / T


def expected_random_jaccard(k: int, T: int) -> float:
    """Exact E[|A ∩ B| / |A ∪ B|] for two independent uniform random K-subsets of T positions.

    |A ∩ B| = x is hypergeometric: P(x) = C(K, x) C(T-K, K-x) / C(T, K), and then
    |A ∪ B| = 2K - x. The sum has at most K+1 terms, evaluated in log space (lgamma) so
    T in the thousands does not overflow.
    """
    if k < 1 or T < 1:
        raise ValueError(f"k and T must be >= 1, got k={k}, T={T}")
    k = min(k, T)

    def log_comb(n: int, r: int) -> float:
        return math.lgamma(n + 1) - math.lgamma(r + 1) - math.lgamma(n - r + 1)

    log_total = log_comb(T, k)
    expectation = 0.0
    for x in range(max(1, 2 * k - T), k + 1):  # x = 0 adds nothing
        log_p = log_comb(k, x) + log_comb(T - k, k - x) - log_total
        expectation += math.exp(log_p) * x / (2 * k - x)
    return expectation
