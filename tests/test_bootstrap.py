"""The paired bootstrap of a corpus-WER difference (metrics/bootstrap.py) against independent references."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from wnw_exp.metrics.bootstrap import paired_bootstrap_wer


def test_point_is_the_corpus_difference_not_a_mean_of_clip_wers():
    # clip 0: A 10/100, B 0/100; clip 1: A 0/10, B 5/10. Corpus A = 10/110, B = 5/110: +4.545 points.
    # (The mean of per-clip differences would be (10 - 50) / 2 = -20: the opposite sign.)
    r = paired_bootstrap_wer([10, 0], [0, 5], [100, 10], n_resamples=200)
    assert r.diff == pytest.approx(100 * 5 / 110)
    assert r.n_clips == 2


def test_interval_of_an_enumerable_corpus_is_its_extreme_resamples():
    # Three clips: every resample is one of 27 equally likely index triples. The most extreme triples repeat one
    # clip three times (probability 1/27 = 3.7% each, above the 2.5% tails), so the 95% percentile interval is
    # [min, max] of the single-clip differences: hand-computed 100 * (e_A - e_B) / ref per clip.
    ea, eb, ref = [3, 1, 8], [1, 2, 2], [40, 20, 60]
    per_clip = [100 * 2 / 40, 100 * -1 / 20, 100 * 6 / 60]  # +5, -5, +10
    enumerated = [100 * sum(ea[i] - eb[i] for i in t) / sum(ref[i] for i in t)
                  for t in itertools.product(range(3), repeat=3)]
    assert min(enumerated) == pytest.approx(min(per_clip)) and max(enumerated) == pytest.approx(max(per_clip))
    r = paired_bootstrap_wer(ea, eb, ref, n_resamples=20_000, seed=3)
    assert (r.low, r.high) == pytest.approx((-5.0, 10.0))
    assert r.diff == pytest.approx(100 * 7 / 120)


def test_fixed_seed_matches_a_plain_numpy_loop():
    rng = np.random.default_rng(11)
    n = 13
    ref = rng.integers(50, 400, n)
    ea, eb = rng.integers(0, 40, n), rng.integers(0, 40, n)
    r = paired_bootstrap_wer(ea, eb, ref, n_resamples=500, seed=7, confidence=0.9)
    draw = np.random.default_rng(7)
    stats = []
    for _ in range(500):  # one resample at a time: n clip indices with replacement
        idx = draw.integers(0, n, size=n)
        stats.append(100 * ea[idx].sum() / ref[idx].sum() - 100 * eb[idx].sum() / ref[idx].sum())
    assert r.low == pytest.approx(np.percentile(stats, 5))
    assert r.high == pytest.approx(np.percentile(stats, 95))
    assert r.diff == pytest.approx(100 * (ea.sum() - eb.sum()) / ref.sum())


def test_identical_methods_give_zero_and_swapping_negates():
    ea, eb, ref = [4, 9, 0, 2, 7], [1, 12, 3, 2, 0], [80, 120, 40, 30, 90]
    same = paired_bootstrap_wer(ea, ea, ref)
    assert (same.diff, same.low, same.high) == (0.0, 0.0, 0.0)
    ab, ba = paired_bootstrap_wer(ea, eb, ref, seed=5), paired_bootstrap_wer(eb, ea, ref, seed=5)
    assert ba.diff == pytest.approx(-ab.diff)
    assert (ba.low, ba.high) == pytest.approx((-ab.high, -ab.low))
    assert ab.low <= ab.diff <= ab.high


def test_same_seed_same_interval_and_significance():
    ea, eb, ref = [30] * 10, [10] * 10, [100] * 10
    r1, r2 = paired_bootstrap_wer(ea, eb, ref, seed=1), paired_bootstrap_wer(ea, eb, ref, seed=1)
    assert r1 == r2
    assert r1.excludes_zero and (r1.low, r1.high) == (20.0, 20.0)


@pytest.mark.parametrize("args, match", [
    (([1, 2], [1], [10, 10]), "one length"),
    (([], [], []), "no clips"),
    (([1], [0], [0]), "no reference words"),
    (([-1], [0], [5]), ">= 0"),
])
def test_bad_input_says_what_is_wrong(args, match):
    with pytest.raises(ValueError, match=match):
        paired_bootstrap_wer(*args)
