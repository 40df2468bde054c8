"""Word alignments for calibration, behind one interface: `build_aligner(cfg).words(sample)`.

Both backends answer the same question: for each word of the sample's reference transcript (split on
whitespace), its time span in seconds, or None where no trustworthy span exists.

- `oracle`: the word timings the data set carries (`Sample.words`; the synthetic set has them from
  espeak). Always trusted.
- `whisperx`: WhisperX forced alignment of the reference, read from the files `wnw-align` writes
  (`<alignment.dir>/<file>.json`, one per sample, in WhisperX's own output format). Words whose
  alignment score is below `min_word_score` (0.85, Appendices D-F) or that WhisperX could not align
  (no start/end, e.g. digits without a wav2vec2 character) get None and are skipped by calibration.

WhisperX pins torch~=2.8 and older transformers, so it never runs in this package's environment: see
`wnw_exp.cli.align` and `wnw_exp.calibration.whisperx_worker`.

Aligned words are matched to the reference words by a sequence alignment on normalised text
(lower-case, letters and digits only), so a reference with punctuation, or an alignment that skipped a
word, still maps every matched word to the right reference position.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from wnw_exp.data.base import Sample, Word

_NON_WORD = re.compile(r"[^\w]+", re.UNICODE)


@dataclass(frozen=True)
class AlignedWord:
    text: str
    start: float | None
    end: float | None
    score: float | None = None  # None for oracle timings


class AlignmentError(ValueError):
    """Alignments are missing or do not belong to the sample."""


def normalise(word: str) -> str:
    return _NON_WORD.sub("", word.lower()).replace("_", "")


def match_to_reference(reference: str, aligned: list[AlignedWord], min_score: float | None = None) -> list[Word | None]:
    """Per whitespace-split reference word: its Word span, or None (unmatched, unaligned, low score)."""
    ref_words = reference.split()
    out: list[Word | None] = [None] * len(ref_words)
    a = [normalise(w) for w in ref_words]
    b = [normalise(w.text) for w in aligned]
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for block in matcher.get_matching_blocks():
        for i in range(block.size):
            ri, ai = block.a + i, block.b + i
            w = aligned[ai]
            if not a[ri] or w.start is None or w.end is None or w.end < w.start:
                continue
            if min_score is not None and (w.score is None or w.score < min_score):
                continue
            out[ri] = Word(ref_words[ri], float(w.start), float(w.end))
    return out


# --- WhisperX output -------------------------------------------------------------------------------
def parse_whisperx(result: dict) -> list[AlignedWord]:
    """Words of a WhisperX alignment result, in order.

    Accepts what `whisperx.align` returns (`{"segments": [...], "word_segments": [...]}`, each word
    `{"word", "start", "end", "score"}` with the last three absent for unalignable words), the same
    wrapped by `wnw-align` (with `id`, `reference`, ... beside it), and the older key `text` for `word`.
    """
    words = result.get("word_segments")
    if words is None:
        words = [w for seg in result.get("segments", []) for w in seg.get("words", [])]
    if words is None or not isinstance(words, list):
        raise AlignmentError("not a WhisperX alignment: no word_segments and no segments[].words")
    out = []
    for w in words:
        text = w.get("word", w.get("text"))
        if text is None:
            raise AlignmentError(f"WhisperX word without text: {w}")
        out.append(AlignedWord(str(text), _num(w.get("start")), _num(w.get("end")), _num(w.get("score"))))
    return out


def _num(x) -> float | None:
    if x is None:
        return None
    x = float(x)
    return None if x != x else x  # NaN -> None


def alignment_filename(sample_id: str) -> str:
    """File name of a sample's alignment: the id with path separators and odd characters replaced."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", sample_id) + ".json"


# --- backends ---------------------------------------------------------------------------------------
class OracleAligner:
    name = "oracle"

    def words(self, sample: Sample) -> list[Word | None]:
        if not sample.words:
            raise AlignmentError(f"sample {sample.id} carries no word timings: alignment=oracle needs a data set "
                                 "with timings (synthetic); use alignment=whisperx (after wnw-align) otherwise")
        aligned = [AlignedWord(w.text, w.start, w.end) for w in sample.words]
        return match_to_reference(sample.reference, aligned)

    def describe(self) -> dict:
        return dict(name=self.name)


class WhisperXAligner:
    name = "whisperx"

    def __init__(self, dir: str, min_word_score: float = 0.85):
        self.dir = Path(dir).expanduser()
        self.min_word_score = float(min_word_score)

    def path(self, sample: Sample) -> Path:
        return self.dir / alignment_filename(sample.id)

    def words(self, sample: Sample) -> list[Word | None]:
        path = self.path(sample)
        if not path.is_file():
            raise AlignmentError(f"no WhisperX alignment for sample {sample.id} ({path}): run `wnw-align` with the "
                                 "same dataset and alignment options first (README: calibration)")
        data = json.loads(path.read_text())
        if "reference" in data and data["reference"].split() != sample.reference.split():
            raise AlignmentError(f"{path} aligns another transcript than sample {sample.id}'s reference: "
                                 "re-run wnw-align")
        return match_to_reference(sample.reference, parse_whisperx(data), self.min_word_score)

    def describe(self) -> dict:
        return dict(name=self.name, dir=str(self.dir), min_word_score=self.min_word_score)


def build_aligner(cfg: dict) -> OracleAligner | WhisperXAligner:
    """`conf/alignment/<name>.yaml` as a dict -> an aligner."""
    name = cfg.get("name")
    if name == "oracle":
        return OracleAligner()
    if name == "whisperx":
        return WhisperXAligner(cfg["dir"], cfg.get("min_word_score", 0.85))
    raise ValueError(f"unknown alignment {name!r}; choose oracle or whisperx")
