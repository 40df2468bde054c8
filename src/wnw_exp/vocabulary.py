"""The word vocabulary shared by the synthetic data set (the words espeak-ng speaks) and the word-level tokenizer
of the tiny models (`model=tiny_random`): the most frequent words of a language in wordfreq. It sits below both
layers, so that a backbone need not import the data set to build its tokenizer."""

from __future__ import annotations

from functools import lru_cache

DEFAULT_VOCAB_SIZE = 1000
# One-letter tokens of the frequency lists are mostly elision or initial fragments ("l", "d", "s");
# only these are real words. "qu" is the fragment of "qu'" in French.
_ONE_LETTER_WORDS = {"en": {"a", "i"}, "fr": {"a", "à", "y"}}
_EXCLUDED = {"fr": {"qu"}}


@lru_cache(maxsize=None)
def _vocabulary(language: str, size: int) -> tuple[str, ...]:
    import wordfreq

    n = max(2 * size, 1000)
    while True:
        ranked = wordfreq.top_n_list(language, n)
        words = [
            w
            for w in ranked
            if w.isalpha()
            and w == w.lower()
            and (len(w) > 1 or w in _ONE_LETTER_WORDS.get(language, set()))
            and w not in _EXCLUDED.get(language, set())
        ]
        if len(words) >= size:
            return tuple(words[:size])
        if len(ranked) < n:
            raise ValueError(f"wordfreq has only {len(words)} usable {language!r} words, asked for {size}")
        n *= 2


def vocabulary(language: str, size: int = DEFAULT_VOCAB_SIZE) -> list[str]:
    """The `size` most frequent alphabetic lower-case words of `language` in wordfreq, in rank order.

    Excluded: tokens with digits, apostrophes or capitals, one-letter fragments other than
    en {a, i} / fr {a, à, y}, and French "qu". Deterministic for a given wordfreq version.
    """
    return list(_vocabulary(language, size))
