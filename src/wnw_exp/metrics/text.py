"""Transcript metrics of the paper's §3.5: truncated WER (jiwer) and truncated BLEU (sacreBLEU).

The recipe, in order, for every (reference, hypothesis) pair:

1. ``normalize`` both sides: lower-case, drop all punctuation except apostrophe and period.
2. Split on whitespace and ``truncate`` the hypothesis to ``floor(1.2 * len(reference words))``
   words. Prefill-only baselines at tight budgets often never emit EOS; without the cut a looping
   hypothesis would add an unbounded number of insertions and swamp every other error.
3. Score: substitutions/deletions/insertions from jiwer, or sacreBLEU corpus BLEU.

Both WER functions return **percent** (the paper reports "6.79", not 0.0679). Corpus WER is total
errors over total reference words, never the mean of per-sample WERs (long samples weigh more).

No torch here on purpose: the report side imports this module without any model stack.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import jiwer
import sacrebleu

DEFAULT_RATIO = 1.2

# Characters kept although their Unicode category is punctuation (P*): the paper keeps the
# apostrophe (contractions: "don't" != "dont") and the period (abbreviations: "e.g.").
_KEPT_PUNCTUATION = frozenset("'.")
# Typographic apostrophes that mean the same thing as ASCII "'" in transcripts ("don’t", French
# "l’école"); mapped to "'" before filtering so the two spellings score as equal.
_APOSTROPHES = {"\u2019": "'", "\u02bc": "'"}


def normalize(text: str) -> str:
    """Lower-case, remove punctuation except ``'`` and ``.``, collapse whitespace (paper §3.5).

    Punctuation is every character of Unicode category ``P*`` (so also « », ¿, —, …); it is
    replaced by a space rather than deleted so hyphenated words do not glue ("well-known" ->
    "well known"). Letters with accents survive ("Élève" -> "élève"): the text is NFC-composed
    first so a decomposed "e + ◌́" is the same word as "é". Symbols (``S*``: $, %, +) are not
    punctuation and are kept. Sentence-final periods are kept too, as the rule says: "end." and
    "end" are different words.
    """
    text = unicodedata.normalize("NFC", text).lower()
    chars = []
    for ch in text:
        ch = _APOSTROPHES.get(ch, ch)
        if ch not in _KEPT_PUNCTUATION and unicodedata.category(ch).startswith("P"):
            ch = " "
        chars.append(ch)
    return " ".join("".join(chars).split())


def truncate(
    hyp_words: Sequence[str], ref_words: Sequence[str], ratio: float | None = DEFAULT_RATIO
) -> list[str]:
    """First ``floor(ratio * len(ref_words))`` hypothesis words; ``ratio=None`` keeps them all.

    Floor is the literal reading of "truncated to 1.2x the ground-truth length": the kept prefix
    never exceeds 1.2x. A 1e-9 slack guards against float products landing just below an integer
    (e.g. 1.2 * 5 must give 6, not 5). With an empty reference the kept prefix is empty.
    """
    if ratio is None:
        return list(hyp_words)
    if ratio < 0:
        raise ValueError(f"truncation ratio must be >= 0, got {ratio}")
    return list(hyp_words[: math.floor(ratio * len(ref_words) + 1e-9)])


@dataclass(frozen=True)
class WerCounts:
    """Edit counts of one or many samples; add them up to get corpus totals."""

    substitutions: int = 0
    deletions: int = 0
    insertions: int = 0
    hits: int = 0
    ref_words: int = 0

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions

    @property
    def wer_percent(self) -> float:
        """100 * errors / ref_words; 0 if there is nothing to score, inf for errors on no words."""
        if self.ref_words == 0:
            return 0.0 if self.errors == 0 else math.inf
        return 100.0 * self.errors / self.ref_words

    def __add__(self, other: WerCounts) -> WerCounts:
        return WerCounts(
            self.substitutions + other.substitutions,
            self.deletions + other.deletions,
            self.insertions + other.insertions,
            self.hits + other.hits,
            self.ref_words + other.ref_words,
        )


def _prepare(reference: str, hypothesis: str, ratio: float | None) -> tuple[list[str], list[str]]:
    """Normalised reference words and normalised, truncated hypothesis words."""
    ref_words = normalize(reference).split()
    hyp_words = truncate(normalize(hypothesis).split(), ref_words, ratio)
    return ref_words, hyp_words


def wer_counts(reference: str, hypothesis: str, ratio: float | None = DEFAULT_RATIO) -> WerCounts:
    """Normalise, truncate, then count edits with ``jiwer.process_words``.

    Empty sides are handled here, not by jiwer (jiwer 3 raises on an empty reference): an empty
    reference makes every remaining hypothesis word an insertion (none remain after truncation
    with a finite ratio, since 1.2 x 0 = 0); an empty hypothesis makes every reference word a
    deletion.
    """
    ref_words, hyp_words = _prepare(reference, hypothesis, ratio)
    if not ref_words:
        return WerCounts(insertions=len(hyp_words))
    if not hyp_words:
        return WerCounts(deletions=len(ref_words), ref_words=len(ref_words))
    out = jiwer.process_words(" ".join(ref_words), " ".join(hyp_words))
    return WerCounts(out.substitutions, out.deletions, out.insertions, out.hits, len(ref_words))


def sample_wer(reference: str, hypothesis: str, ratio: float | None = DEFAULT_RATIO) -> float:
    """Truncated WER of one sample, in percent (see ``WerCounts.wer_percent`` for empty refs)."""
    return wer_counts(reference, hypothesis, ratio).wer_percent


def corpus_wer_counts(
    pairs: Iterable[tuple[str, str]], ratio: float | None = DEFAULT_RATIO
) -> WerCounts:
    """Summed edit counts over ``(reference, hypothesis)`` pairs."""
    total = WerCounts()
    for reference, hypothesis in pairs:
        total = total + wer_counts(reference, hypothesis, ratio)
    return total


def corpus_wer(pairs: Iterable[tuple[str, str]], ratio: float | None = DEFAULT_RATIO) -> float:
    """Truncated corpus WER in percent: 100 * total errors / total reference words.

    This is what jiwer reports for a list of sentences and what the paper's tables hold; it is
    not the mean of per-sample WERs (which would let a 10-word sample weigh like a 600-word one).
    """
    return corpus_wer_counts(pairs, ratio).wer_percent


def corpus_bleu(pairs: Iterable[tuple[str, str]], ratio: float | None = DEFAULT_RATIO) -> float:
    """sacreBLEU corpus BLEU (0..100) with the WER recipe's normalisation and truncation.

    Both sides go through ``normalize`` (the paper only says "same truncation"; normalising both
    sides keeps casing/punctuation out of the score the same way it is kept out of WER), then the
    hypothesis is cut to ``floor(ratio * reference words)`` normalised words, so a non-terminating
    translation is scored on its prefix. sacreBLEU's default 13a tokenizer then runs as usual.
    """
    refs, hyps = [], []
    for reference, hypothesis in pairs:
        ref_words, hyp_words = _prepare(reference, hypothesis, ratio)
        refs.append(" ".join(ref_words))
        hyps.append(" ".join(hyp_words))
    if not refs:
        raise ValueError("corpus_bleu needs at least one (reference, hypothesis) pair")
    return float(sacrebleu.corpus_bleu(hyps, [refs]).score)
