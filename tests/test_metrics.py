"""Truncated WER / BLEU (paper §3.5) on hand-computed cases; the arithmetic is in the comments."""

import math
import unicodedata

import pytest

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

REF5 = "one two three four five"


# --- normalize ---------------------------------------------------------------------------------


def test_normalize_case_punctuation_whitespace():
    assert normalize("  Hello,   World!\n") == "hello world"
    assert normalize("well-known") == "well known"  # hyphen -> space, words do not glue
    assert normalize("«Bonjour», dit-il…") == "bonjour dit il"  # guillemets, ellipsis are P*


def test_normalize_keeps_apostrophe_period_and_accents():
    assert normalize("Élève") == "élève"
    assert normalize("Don't stop, e.g. now.") == "don't stop e.g. now."
    assert normalize("don\u2019t") == "don't"  # typographic apostrophe == ASCII apostrophe
    decomposed = unicodedata.normalize("NFD", "école")
    assert normalize(decomposed) == "école"  # e + combining acute composes to é


# --- truncate ----------------------------------------------------------------------------------


def test_truncate_floor_of_ratio_times_reference():
    hyp = list("abcdefghij")
    assert truncate(hyp, ["w"] * 5) == hyp[:6]  # floor(1.2 * 5) = 6 (not 5 from float error)
    assert truncate(hyp, ["w"] * 3) == hyp[:3]  # floor(1.2 * 3 = 3.6) = 3
    assert truncate(hyp, []) == []  # floor(1.2 * 0) = 0
    assert truncate(hyp, ["w"] * 3, ratio=None) == hyp


# --- WER ---------------------------------------------------------------------------------------


def test_exact_match_is_zero():
    assert sample_wer("the cat sat down", "the cat sat down") == 0.0


def test_one_substitution_in_four_words_is_25_percent():
    # cat -> dog: S=1, N=4 -> 1/4 = 25%
    counts = wer_counts("the cat sat down", "the dog sat down")
    assert counts == WerCounts(substitutions=1, deletions=0, insertions=0, hits=3, ref_words=4)
    assert sample_wer("the cat sat down", "the dog sat down") == pytest.approx(25.0)


def test_punctuation_and_case_ignored():
    assert sample_wer("Hello, World!", "hello world") == 0.0


def test_apostrophe_kept():
    # "don't" vs "dont": S=1, N=3 -> 33.3%
    assert sample_wer("I don't know", "i dont know") == pytest.approx(100 / 3)
    assert sample_wer("I don't know", "I don\u2019t know") == 0.0


def test_period_kept_abbreviation_and_sentence_final():
    # "e.g." vs "eg": S=1, N=3 -> 33.3%
    assert sample_wer("see e.g. this", "see eg this") == pytest.approx(100 / 3)
    # The paper keeps periods, so a sentence-final "end." is a different word from "end":
    # S=1, N=2 -> 50%. Deliberate: we follow the stated rule, not Whisper-style normalisers.
    assert wer_counts("the end.", "the end").substitutions == 1
    assert sample_wer("the end.", "the end") == pytest.approx(50.0)


def test_non_terminating_hypothesis_is_truncated():
    # ref N=5; hyp = ref + 50 x "la" -> cut to floor(1.2*5)=6 words -> 1 insertion -> 1/5 = 20%
    hyp = REF5 + " la" * 50
    assert wer_counts(REF5, hyp) == WerCounts(0, 0, 1, 5, 5)
    assert sample_wer(REF5, hyp) == pytest.approx(20.0)
    # without truncation: 50 insertions / 5 = 1000%
    assert sample_wer(REF5, hyp, ratio=None) == pytest.approx(1000.0)


def test_looping_wrong_word_is_bounded():
    # hyp "uh uh uh ..." cut to 6 words, none matching: 5 substitutions + 1 insertion = 6/5 = 120%
    hyp = "uh " * 1000
    assert wer_counts(REF5, hyp) == WerCounts(5, 0, 1, 0, 5)
    assert sample_wer(REF5, hyp) == pytest.approx(120.0)


def test_empty_hypothesis_is_all_deletions():
    assert wer_counts(REF5, "") == WerCounts(0, 5, 0, 0, 5)
    assert wer_counts(REF5, " ,!? ") == WerCounts(0, 5, 0, 0, 5)  # punctuation-only -> empty
    assert sample_wer(REF5, "") == pytest.approx(100.0)


def test_empty_reference_does_not_crash():
    # truncation to floor(1.2*0) = 0 words removes everything -> no errors
    assert wer_counts("", "some words here") == WerCounts()
    assert sample_wer("", "some words here") == 0.0
    # without truncation: 3 insertions on 0 reference words
    assert wer_counts("", "some words here", ratio=None) == WerCounts(insertions=3)
    assert math.isinf(sample_wer("", "some words here", ratio=None))
    assert sample_wer("", "") == 0.0
    assert wer_counts("!!", "") == WerCounts()  # punctuation-only reference is empty too


def test_corpus_wer_is_total_errors_over_total_words_not_mean():
    pairs = [
        ("hello there", "hello"),  # 1 deletion / 2 words = 50%
        ("a b c d e f g h", "a b c d e f g h"),  # 0 / 8 = 0%
    ]
    # mean of sample WERs would be (50 + 0) / 2 = 25%; corpus WER is (1 + 0) / (2 + 8) = 10%
    assert corpus_wer(pairs) == pytest.approx(10.0)
    assert corpus_wer_counts(pairs) == WerCounts(0, 1, 0, 9, 10)
    assert corpus_wer(iter(pairs)) == pytest.approx(10.0)  # any iterable, consumed once


# --- BLEU --------------------------------------------------------------------------------------


def test_bleu_identical_is_100():
    ref = "the quick brown fox jumps over the lazy dog"
    assert corpus_bleu([(ref, ref), ("Hello there, my friend!", "hello there my friend")]) == (
        pytest.approx(100.0)
    )


def test_bleu_truncation_cuts_endless_repetition():
    # ref 5 words; hyp cut to 6 = ref + one "la". n-gram precisions 5/6, 4/5, 3/4, 2/3, product
    # 1/3; hyp longer than ref so brevity penalty 1: BLEU = 100 * (1/3) ** (1/4) = 75.98
    expected = 100 * (1 / 3) ** 0.25
    assert corpus_bleu([(REF5, REF5 + " la" * 50)]) == pytest.approx(expected, abs=1e-6)
    assert corpus_bleu([(REF5, REF5 + " la")]) == pytest.approx(expected, abs=1e-6)
    assert corpus_bleu([(REF5, REF5 + " la" * 50)], ratio=None) < 30.0


def test_bleu_keeps_french_accents():
    ref = "L'élève écoute le professeur attentivement"
    # case and typographic apostrophe are normalised away -> identical
    hyp = "l\u2019Élève écoute le professeur attentivement"
    assert corpus_bleu([(ref, hyp)]) == pytest.approx(100.0)
    # stripped accents are real errors
    assert corpus_bleu([(ref, "l'eleve ecoute le professeur attentivement")]) < 100.0


def test_bleu_needs_pairs():
    with pytest.raises(ValueError):
        corpus_bleu([])
