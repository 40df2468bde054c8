"""Prefill/decode attention-mismatch statistics (paper §2.1) on hand-made distributions."""

import itertools

import numpy as np
import pytest

from wnw_exp.metrics.mismatch import (
    cumulative,
    expected_random_jaccard,
    mass_fractions,
    random_jaccard_baseline,
    resample_to_grid,
    topk_jaccard,
)


def test_all_mass_on_first_position():
    p = np.zeros(20)
    p[0] = 3.0  # unnormalised on purpose
    expected = {"first10": 1.0, "first_half": 1.0, "second_half": 0.0}
    assert mass_fractions(p) == pytest.approx(expected)


def test_uniform_over_ten_positions():
    assert mass_fractions(np.ones(10)) == pytest.approx(
        {"first10": 0.1, "first_half": 0.5, "second_half": 0.5}
    )


def test_positions_straddling_a_boundary_are_split():
    # T=5: position 0 covers [0, 0.2); the first 10% holds half of it -> 0.5
    assert mass_fractions([1, 0, 0, 0, 0])["first10"] == pytest.approx(0.5)
    # T=3 uniform: first half = 1/3 + half of the middle 1/3 = 0.5
    assert mass_fractions([1, 1, 1])["first_half"] == pytest.approx(0.5)


def test_cumulative():
    assert cumulative(np.array([1.0, 1.0, 2.0])) == pytest.approx([0.25, 0.5, 1.0])


def test_bad_distributions_rejected():
    for bad in ([], [0, 0], [1, -1, 1]):
        with pytest.raises(ValueError):
            mass_fractions(bad)


def test_jaccard_identical_and_disjoint():
    a = np.array([5.0, 4.0, 0.0, 0.0])
    assert topk_jaccard(a, a, 2) == 1.0
    assert topk_jaccard(a, a[::-1], 2) == 0.0  # {0, 1} vs {2, 3}


def test_jaccard_partial_overlap():
    a = np.array([9.0, 8.0, 7.0, 0.0, 0.0, 0.0])  # top-3 {0, 1, 2}
    b = np.array([0.0, 0.0, 9.0, 8.0, 7.0, 0.0])  # top-3 {2, 3, 4}
    assert topk_jaccard(a, b, 3) == pytest.approx(1 / 5)  # |{2}| / |{0,1,2,3,4}|
    # top-2: {0, 1} vs {2, 3} -> 0; top-1 {0} vs {2} -> 0
    assert topk_jaccard(a, b, 2) == 0.0
    c = np.array([0.0, 9.0, 8.0, 0.0, 0.0, 0.0])  # top-2 {1, 2}
    assert topk_jaccard(a, c, 2) == pytest.approx(1 / 3)  # |{1}| / |{0,1,2}|


def test_jaccard_k_clipped_and_validated():
    a, b = np.arange(4.0), -np.arange(4.0)
    assert topk_jaccard(a, b, 100) == 1.0  # k -> 4: both sets are all positions
    with pytest.raises(ValueError):
        topk_jaccard(a, b, 0)
    with pytest.raises(ValueError):
        topk_jaccard(a, np.arange(3.0), 2)


def test_random_baseline_is_k_over_t():
    assert random_jaccard_baseline(100, 8000) == pytest.approx(0.0125)
    assert random_jaccard_baseline(50, 10) == 1.0


def test_expected_random_jaccard_hand_computed():
    # T=2, K=1: same element with prob 1/2 (J=1), else J=0 -> 0.5
    assert expected_random_jaccard(1, 2) == pytest.approx(0.5)
    # T=4, K=2: |A∩B| = 0, 1, 2 with prob 1/6, 4/6, 1/6; J = 0, 1/3, 1
    # E = 4/6 * 1/3 + 1/6 = 7/18   (the paper's K/T would say 0.5)
    assert expected_random_jaccard(2, 4) == pytest.approx(7 / 18)
    assert expected_random_jaccard(5, 5) == pytest.approx(1.0)


def test_expected_random_jaccard_matches_enumeration():
    T, k = 7, 3
    subsets = [set(s) for s in itertools.combinations(range(T), k)]
    brute = np.mean([len(a & b) / len(a | b) for a in subsets for b in subsets])
    assert expected_random_jaccard(k, T) == pytest.approx(brute)


def test_expected_random_jaccard_large_t_is_about_half_of_k_over_t():
    # K << T: |A∩B| ≈ K²/T, |A∪B| ≈ 2K -> E[J] ≈ K/(2T); no overflow at T in the thousands
    value = expected_random_jaccard(100, 8000)
    assert value == pytest.approx(100 / (2 * 8000), rel=0.05)


def test_resample_preserves_mass_and_uniformity():
    rng = np.random.default_rng(0)
    p = rng.random(137)
    assert resample_to_grid(p, 50).sum() == pytest.approx(1.0)
    assert resample_to_grid(np.ones(7), 10) == pytest.approx(np.full(10, 0.1))
    assert resample_to_grid(np.ones(1000), 7) == pytest.approx(np.full(7, 1 / 7))


def test_resample_hand_computed():
    # position 0 of 2 covers [0, 0.5) -> bins [0, .25) and [.25, .5) each get half
    assert resample_to_grid(np.array([1.0, 0.0]), 4) == pytest.approx([0.5, 0.5, 0.0, 0.0])
    # middle of 3 positions covers [1/3, 2/3): split evenly across the two halves
    assert resample_to_grid(np.array([0.0, 1.0, 0.0]), 2) == pytest.approx([0.5, 0.5])
    with pytest.raises(ValueError):
        resample_to_grid(np.ones(3), 0)
