"""Synthetic long-form speech: random word sequences spoken by espeak-ng, with exact word timings.

The audio comes from the libespeak-ng bundled by the PyPI package `espeakng-loader` (version 1.52),
driven through ctypes in synchronous mode: the synth callback hands us the 22,050 Hz int16 audio
and the WORD events, whose `sample` field is the word's start as a sample offset in the output.

Determinism. espeak-ng keeps synthesis state in C statics that neither `espeak_Terminate` nor
`espeak_Initialize` reset (the pitch-flutter index, the glottal phase), so the same text gives
slightly different samples depending on what was spoken before in the process. We therefore load
a private copy of the library, synthesize one clip, and unload it (`dlclose`) before the next clip:
every clip starts from a freshly loaded library (~2 ms), and the random seeds of espeak
(`espeak_ng_SetRandSeed`) and of libc (`srand`, used by the Klatt voices) are fixed. A clip is then
a pure function of its parameters, identical across calls and processes (same espeak-ng, soxr and
wordfreq versions). If something else in the process has loaded the same library file, dlclose
cannot unload it; that is detected (once, via /proc/self/maps) and reported by a RuntimeWarning.

Clip recipe (`synthesize_clip`), all draws from `numpy.random.default_rng([seed, index])`:
voice uniform over `voices` (a list, or a preset of `wnw_exp.data.voices`), rate (words per minute) uniform
over the integers of `rate_range`, target duration uniform in [min_seconds, max_seconds]; then sentences of 8-20
words drawn uniformly (with replacement) from the vocabulary, each spoken as one utterance ending with a full
stop, followed by a pause of 0.15-0.6 s, until the target duration is reached. A sentence whose words
cannot all be timed (see `_word_starts`) is discarded and another one drawn. If the last sentence
overshoots `max_seconds`, its words that end after `max_seconds - 0.1 s` are dropped and the audio is
cut 0.1 s after the last kept word (never into the next word); a clip shorter than `min_seconds`
after that is padded with silence. A neural voice (`piper:<voice>`, `wnw_exp.data.piper_voices`) speaks the same
sentences; it gives no word timings, so each word of its clips carries its sentence's span, the cut keeps whole
sentences, and `SyntheticDataset` samples of such clips have `words=None`.

Word timing rule. Within one sentence, word i owns the slot [event_i, event_{i+1}) (the last word:
[event_i, end of the sentence's audio)). Its start and end are the first and one-past-the-last
sample of the slot whose magnitude exceeds -54 dBFS (espeak's pauses are exact zeros), i.e. leading
and trailing silence (pauses, a stop's closure before the word) are trimmed. Times are in seconds
of the final 16 kHz clip, in order and non-overlapping (a word may start where the previous ends).

Audio is resampled to 16 kHz with soxr (HQ) and quantised to the int16 grid (float32 = int16 /
32768), so the FLAC cache round-trips bit-exactly.

Data set splits (`SyntheticDataset`): clip i of split s with dataset seed k is
`synthesize_clip(SPLIT_SEED_BASE[s] + k, i)`, with bases test 0, dev 100_000, calib 200_000,
train 1_000_000 (k must be below 100_000 for test/dev/calib), so the generator streams of the splits
are disjoint by construction. `train` clips are generated on the fly (not cached) unless asked.
"""

from __future__ import annotations

import _ctypes
import ctypes
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import soundfile as sf
import soxr

from wnw_exp.paths import cache_root
from wnw_exp.vocabulary import DEFAULT_VOCAB_SIZE, vocabulary

from . import piper_voices, voices as voice_sets
from .base import SAMPLE_RATE, Sample, Word
from .dataset import select

# espeak-ng "<voice file>+<variant>" names ("en" is British English; "en-gb" is not a voice name), all checked to
# exist in the bundled data (the `six` preset). Measured median F0: en-us/en+m3 ~105 Hz, m8 ~87 Hz, f4 ~182 Hz,
# f2 ~200 Hz, f5 ~208 Hz; with several accents (US, British, RP, Scottish; French of France, Belgium,
# Switzerland) the clips differ in pitch, formants and pronunciation.
DEFAULT_VOICES: dict[str, tuple[str, ...]] = voice_sets.SIX
DEFAULT_RATE_RANGE = voice_sets.SIX_RATES
SENTENCE_WORDS = (8, 20)  # inclusive range of words per synthesised sentence
PAUSE_SECONDS = (0.15, 0.6)  # silence appended after each sentence
CUT_MARGIN_SECONDS = 0.1
SILENCE_THRESHOLD = 64  # int16 magnitude, about -54 dBFS
SPLIT_SEED_BASE = {"test": 0, "dev": 100_000, "calib": 200_000, "train": 1_000_000}
SYNTH_VERSION = 1  # bump when the recipe changes: it is part of the cache key

# --------------------------------------------------------------------------------------------
# espeak-ng through ctypes


class _EventId(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p), ("string", ctypes.c_char * 8)]


class _Event(ctypes.Structure):
    """`espeak_EVENT` of speak_lib.h (espeak-ng 1.52); 40 bytes on 64-bit."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),  # 1-based character position in the text
        ("length", ctypes.c_int),
        ("audio_position", ctypes.c_int),  # ms
        ("sample", ctypes.c_int),  # sample offset in the output
        ("user_data", ctypes.c_void_p),
        ("id", _EventId),
    ]


_EVENT_LIST_TERMINATED = 0
_EVENT_WORD = 1
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_PARAM_RATE = 1
_ESPEAK_RATE = 22_050

_SynthCallback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))
_lock = threading.Lock()
_chunks: list[np.ndarray] = []
_events: list[tuple[int, int, int]] = []  # (word number, text position, sample)


def _on_synth(wav, n, events) -> int:  # called by espeak from inside espeak_Synth
    if wav and n > 0:
        _chunks.append(np.ctypeslib.as_array(wav, (n,)).copy())
    i = 0
    while events[i].type != _EVENT_LIST_TERMINATED:
        e = events[i]
        if e.type == _EVENT_WORD:
            _events.append((e.id.number, e.text_position, e.sample))
        i += 1
    return 0


_callback = _SynthCallback(_on_synth)


@lru_cache(maxsize=None)
def _private_library_path() -> str:
    """A copy of the bundled libespeak-ng that only this module dlopens, so dlclose really unloads it.

    Copied once into the cache folder (or the temp folder if that is not writable); falls back to
    the bundled file if neither is writable.
    """
    import espeakng_loader

    src = Path(espeakng_loader.get_library_path())
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    for folder in (cache_root() / "espeak", Path(tempfile.gettempdir()) / "wnw_exp-espeak"):
        dst = folder / f"libespeak-ng-wnw-{digest}{src.suffix}"
        if dst.exists():
            return str(dst)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
            return str(dst)
        except OSError:
            continue
    return str(src)


_unload_checked = False


def _check_unloaded(path: str) -> None:
    """Warn once if dlclose left the library mapped (then clips may differ in their last bits)."""
    global _unload_checked
    _unload_checked = True
    maps = Path("/proc/self/maps")
    if maps.exists() and path in maps.read_text():
        warnings.warn(
            f"{path} stayed loaded after dlclose (another module loaded it too?): espeak state carries over "
            "between clips, so synthetic clips are not bit-exact reproducible in this process",
            RuntimeWarning,
        )


class _Espeak:
    """A freshly loaded libespeak-ng for one clip (use as a context manager; hold `_lock`)."""

    def __enter__(self) -> "_Espeak":
        import espeakng_loader

        try:
            self.path = _private_library_path()
            self.lib = ctypes.CDLL(self.path, mode=ctypes.RTLD_LOCAL)
        except OSError:  # e.g. a noexec cache directory: fall back to the bundled file
            self.path = espeakng_loader.get_library_path()
            self.lib = ctypes.CDLL(self.path, mode=ctypes.RTLD_LOCAL)
        lib = self.lib
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
        lib.espeak_Synth.argtypes = [
            ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
        ]  # fmt: skip
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, espeakng_loader.get_data_path().encode(), 0)
        if rate != _ESPEAK_RATE:
            raise RuntimeError(f"espeak_Initialize returned {rate}, expected {_ESPEAK_RATE} Hz")
        lib.espeak_SetSynthCallback(_callback)
        lib.espeak_ng_SetRandSeed(0)
        ctypes.CDLL(None).srand(0)
        return self

    def set_voice(self, voice: str, rate: int) -> None:
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"espeak-ng has no voice {voice!r} in the bundled data")
        self.lib.espeak_SetParameter(_PARAM_RATE, int(rate), 0)

    def speak(self, words: Sequence[str]) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """int16 audio at 22,050 Hz of `words` as one sentence, and each word's [start, end) in samples."""
        text = " ".join(words)
        if text[-1] not in ".!?":
            text += "."
        data = text.encode()
        _chunks.clear()
        _events.clear()
        if self.lib.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None) != 0:
            raise RuntimeError(f"espeak_Synth failed on {text!r}")
        self.lib.espeak_Synchronize()
        audio = np.concatenate(_chunks) if _chunks else np.zeros(0, np.int16)
        starts = _word_starts(words, list(_events), len(audio))
        return audio, _trim_slots(audio, starts)

    def __exit__(self, *exc) -> None:
        self.lib.espeak_Terminate()
        handle = self.lib._handle
        del self.lib
        _ctypes.dlclose(handle)
        if not _unload_checked:
            _check_unloaded(self.path)


class UnalignedSentence(RuntimeError):
    """espeak's WORD events do not give every word of a sentence a start of its own."""


def _word_starts(words: Sequence[str], events: list[tuple[int, int, int]], n_samples: int) -> list[int]:
    """Start sample of each word: the first WORD event whose text position falls inside the word.

    Positions are mapped rather than events counted because espeak may emit several WORD events
    for one token ("ii" is read as two letters). A word left without an event raises
    `UnalignedSentence`: espeak spoke it inside a neighbour's slot ("does not" is one group, no
    event for "not") or misreported a position (after "dr", read "doctor"); its timing would be
    a guess, so the caller draws another sentence instead.
    """
    first_char = np.cumsum([0] + [len(w) + 1 for w in words[:-1]]) + 1  # 1-based, as espeak counts
    starts: dict[int, int] = {}
    for _, position, sample in events:
        k = int(np.searchsorted(first_char, position, side="right")) - 1
        if 0 <= k < len(words) and position < first_char[k] + len(words[k]):
            starts.setdefault(k, min(max(sample, 0), n_samples))
    if len(starts) != len(words):
        missing = [words[k] for k in range(len(words)) if k not in starts]
        raise UnalignedSentence(f"espeak gave no WORD event for {missing} in {' '.join(words)!r}")
    return list(np.maximum.accumulate([starts[k] for k in range(len(words))]))


def _trim_slots(audio: np.ndarray, starts: list[int]) -> list[tuple[int, int]]:
    bounds = starts[1:] + [len(audio)]
    spans = []
    for s, e in zip(starts, bounds):
        voiced = np.flatnonzero(np.abs(audio[s:e].astype(np.int32)) > SILENCE_THRESHOLD)
        spans.append((s + int(voiced[0]), s + int(voiced[-1]) + 1) if len(voiced) else (s, max(e, s + 1)))
    return spans


# --------------------------------------------------------------------------------------------
# clips


def synthesize_clip(
    seed: int,
    index: int,
    *,
    language: str = "en",
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    voices: str | Sequence[str] | None = None,
    min_seconds: float = 50.0,
    max_seconds: float = 70.0,
    rate_range: tuple[int, int] | None = None,
    text: str = "random",
    text_split: str | None = None,
) -> tuple[np.ndarray, list[Word]]:
    """One clip: float32 mono 16 kHz audio and its words with [start, end) times in seconds.

    Deterministic in all its arguments (see the module docstring for the recipe). `text="natural"` speaks
    consecutive sentences of the natural-text corpus's `text_split` passages (English only), from a passage
    drawn with the clip's generator, instead of random vocabulary words; `text="shuffled"` the same sentences
    with each one's words in a random order; `text="kjv"` the King James Bible's chapters (`wnw_exp.data.kjv`).
    `voices` and `rate_range` default to the six voices and their rates (a preset name brings its own rates).
    """
    if not 0 < min_seconds <= max_seconds:
        raise ValueError(f"need 0 < min_seconds <= max_seconds, got {min_seconds}, {max_seconds}")
    voices, preset_rates = voice_sets.resolve(voices, language)
    rate_range = tuple(rate_range) if rate_range else (preset_rates or DEFAULT_RATE_RANGE)
    rng = np.random.default_rng([int(seed), int(index)])
    voice = voices[int(rng.integers(len(voices)))]
    rate = int(rng.integers(rate_range[0], rate_range[1] + 1))
    target = float(rng.uniform(min_seconds, max_seconds))
    sentences = _sentence_source(text, text_split, language, vocab_size, rng)

    pieces: list[np.ndarray] = []
    spans: list[tuple[str, int, int]] = []  # word, start, end in samples at 22,050 Hz
    total = 0
    if piper_voices.is_neural(voice):
        while total < target * _ESPEAK_RATE:  # Piper's rate is espeak's: 22,050 Hz
            words = next(sentences)
            audio = piper_voices.speak(voice, words, rate)
            pause = np.zeros(int(rng.uniform(*PAUSE_SECONDS) * _ESPEAK_RATE), np.int16)
            spans += [(w, total, total + len(audio)) for w in words]  # no word timings: the sentence's span
            pieces += [audio, pause]
            total += len(audio) + len(pause)
    else:
        with _lock, _Espeak() as espeak:
            espeak.set_voice(voice, rate)
            rejected = 0
            while total < target * _ESPEAK_RATE:
                words = next(sentences)
                try:
                    audio, word_spans = espeak.speak(words)
                except UnalignedSentence:
                    rejected += 1  # random words: roughly 1 sentence in 500-5000, natural text more: take the next
                    if rejected > 100:
                        raise
                    continue
                pause = np.zeros(int(rng.uniform(*PAUSE_SECONDS) * _ESPEAK_RATE), np.int16)
                spans += [(w, total + s, total + e) for w, (s, e) in zip(words, word_spans)]
                pieces += [audio, pause]
                total += len(audio) + len(pause)
    audio = np.concatenate(pieces)

    limit = int(max_seconds * _ESPEAK_RATE)
    if len(audio) > limit:
        margin = int(CUT_MARGIN_SECONDS * _ESPEAK_RATE)
        kept = [sp for sp in spans if sp[2] <= limit - margin]
        cut = min(kept[-1][2] + margin, limit) if kept else limit
        following = [sp[1] for sp in spans[len(kept) :]]
        if following:
            cut = min(cut, following[0])
        spans, audio = kept, audio[:cut]
    audio16 = soxr.resample(audio.astype(np.float32) / 32768.0, _ESPEAK_RATE, SAMPLE_RATE, quality="HQ")
    minimum = int(np.ceil(min_seconds * SAMPLE_RATE))
    if len(audio16) < minimum:
        audio16 = np.concatenate([audio16, np.zeros(minimum - len(audio16), np.float32)])
    audio16 = _quantize(audio16)
    duration = len(audio16) / SAMPLE_RATE
    words_out = [
        Word(w, round(float(s) / _ESPEAK_RATE, 4), min(round(float(e) / _ESPEAK_RATE, 4), duration)) for w, s, e in spans
    ]
    return audio16, words_out


TEXTS = ("random", "natural", "shuffled", "kjv")


def clip_voice(seed: int, index: int, voices: str | Sequence[str] | None = None, language: str = "en") -> str:
    """The voice `synthesize_clip(seed, index, voices=voices)` speaks with (its first draw)."""
    names, _ = voice_sets.resolve(voices, language)
    return names[int(np.random.default_rng([int(seed), int(index)]).integers(len(names)))]


def _sentence_source(text: str, text_split: str | None, language: str, vocab_size: int,
                     rng: np.random.Generator) -> Iterator[list[str]]:
    """Endless sentences (lists of whitespace-separated words) for one clip, drawn with the clip's `rng`."""
    if text == "random":
        vocab = vocabulary(language, vocab_size)
        while True:
            n_words = int(rng.integers(SENTENCE_WORDS[0], SENTENCE_WORDS[1] + 1))
            yield [vocab[k] for k in rng.integers(len(vocab), size=n_words)]
    if text not in TEXTS:
        raise ValueError(f"synthetic text={text!r}: choose one of {', '.join(TEXTS)}")
    if language != "en":
        raise ValueError(f"{text} text is English only: use dataset.language=en or dataset.text=random")
    if text == "kjv":
        from wnw_exp.data.kjv import split_sentences
    else:
        from wnw_exp.data.natural_text import split_sentences

    passages = split_sentences(text_split or "test")
    p = int(rng.integers(len(passages)))
    while True:  # consecutive passages of the split from a random one, wrapping around
        for sentence in passages[p % len(passages)]:
            words = sentence.split()
            # "shuffled": the same words in a random order (each keeps its case and punctuation): speech whose
            # transcript a language model cannot guess, for training a decoder to read the audio
            yield [words[i] for i in rng.permutation(len(words))] if text == "shuffled" else words
        p += 1


def _quantize(audio: np.ndarray) -> np.ndarray:
    """Round to the int16 grid so FLAC (PCM_16) stores the clip exactly."""
    ints = np.clip(np.round(audio * 32768.0), -32768, 32767).astype(np.int16)  # also turns -0.0 into 0
    return ints.astype(np.float32) / np.float32(32768.0)


# --------------------------------------------------------------------------------------------
# data set


@dataclass
class SyntheticDataset:
    """`n` synthetic clips of one split (see the module docstring for seeds and the recipe).

    Clips are cached as `<cache_dir>/<key[:2]>/<key>.flac` + `.json`, the key hashing every
    parameter of the clip; a second run reads them instead of synthesising. `cache=None` means
    cached for every split except `train`. `shard`/`num_shards` keep clips i with
    i % num_shards == shard.
    """

    n: int = 8
    split: str = "test"
    seed: int = 0
    min_seconds: float = 50.0
    max_seconds: float = 70.0
    voices: str | Sequence[str] | None = None  # a list of voice names or a preset (`wnw_exp.data.voices`)
    rate_range: tuple[int, int] | None = None  # None: the preset's (150-200 wpm for the six voices)
    language: str = "en"
    vocab_size: int | None = DEFAULT_VOCAB_SIZE  # None: DEFAULT_VOCAB_SIZE
    cache_dir: str | os.PathLike | None = None
    cache: bool | None = None
    shard: int = 0
    num_shards: int = 1
    text: str = "random"  # random (vocabulary words) | natural | shuffled (the natural-text corpus of the same
    # split) | kjv (the King James Bible's chapters of the same split)
    name: str = "synthetic"

    def __post_init__(self) -> None:
        if self.split not in SPLIT_SEED_BASE:
            raise ValueError(f"synthetic split must be one of {sorted(SPLIT_SEED_BASE)}, got {self.split!r}")
        if self.split != "train" and not 0 <= self.seed < 100_000:
            raise ValueError(f"synthetic seed must be in [0, 100000) for split {self.split!r}, got {self.seed}")
        self.voices, preset_rates = voice_sets.resolve(self.voices, self.language)
        self.vocab_size = int(self.vocab_size or DEFAULT_VOCAB_SIZE)
        if self.text not in TEXTS:
            raise ValueError(f"dataset.text={self.text!r}: choose one of {', '.join(TEXTS)}")
        self.rate_range = tuple(self.rate_range) if self.rate_range else (preset_rates or DEFAULT_RATE_RANGE)
        piper_voices.check(self.voices)  # missing optional packages: one line now, not an error per clip
        if self.text == "kjv":
            from .kjv import database

            database()
        if len(self.rate_range) != 2 or not 0 < self.rate_range[0] <= self.rate_range[1]:
            raise ValueError(f"dataset.rate_range={list(self.rate_range)}: give [min, max] words per minute, "
                             "0 < min <= max")
        if self.cache is None:
            self.cache = self.split != "train"
        self.cache_dir = Path(self.cache_dir).expanduser() if self.cache_dir else cache_root() / "synthetic"
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"dataset.n={self.n!r} selects no sample: the synthetic data set needs n >= 1 clips")
        self.indices = select(range(self.n), None, 0, self.shard, self.num_shards)

    @property
    def clip_seed(self) -> int:
        return SPLIT_SEED_BASE[self.split] + self.seed

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def ids(self) -> list[str]:
        """The selected clips' ids, in order, without synthesising them."""
        return [self._id(index) for index in self.indices]

    def _id(self, index: int) -> str:
        return f"synthetic-{self.split}-{index}"

    def __iter__(self) -> Iterator[Sample]:
        return (self[i] for i in range(len(self)))

    def __getitem__(self, i: int) -> Sample:
        index = self.indices[i]
        params = self._clip_params(index)
        sample_id = self._id(index)
        timed = not piper_voices.is_neural(clip_voice(params["seed"], index, self.voices))
        if not self.cache:
            audio, words = synthesize_clip(**params)
            return self._sample(sample_id, lambda: audio, len(audio) / SAMPLE_RATE, words, timed)
        flac, meta = self._paths(params)
        if not (flac.exists() and meta.exists()):
            audio, words = synthesize_clip(**params)
            _write_clip(flac, meta, audio, words, params)
        info = json.loads(meta.read_text())
        words = [Word(*w) for w in info["words"]]
        return self._sample(sample_id, lambda: _read_clip(flac), info["duration"], words, timed)

    def _sample(self, sample_id: str, load, duration: float, words: list[Word], timed: bool = True) -> Sample:
        return Sample(
            id=sample_id,
            load_audio=load,
            duration=duration,
            reference=" ".join(w.text for w in words),
            language=self.language,
            words=words if timed else None,  # a neural voice's clip has sentence spans only
        )

    def _clip_params(self, index: int) -> dict:
        return dict(
            seed=self.clip_seed,
            index=index,
            language=self.language,
            vocab_size=self.vocab_size,
            voices=list(self.voices),
            min_seconds=float(self.min_seconds),
            max_seconds=float(self.max_seconds),
            rate_range=list(self.rate_range),
            # natural text: its own keys (random-word clips keep the parameters, so the cache keys, they had)
            **(dict(text=self.text, text_split=self.split) if self.text != "random" else {}),
        )

    def _paths(self, params: dict) -> tuple[Path, Path]:
        neural = piper_voices.versions(params["voices"])  # only when a neural voice is in the list: older keys stay
        key_src = json.dumps({**params, "version": SYNTH_VERSION, "espeak": espeak_version(),
                              **({"neural": neural} if neural else {})}, sort_keys=True)
        key = hashlib.sha256(key_src.encode()).hexdigest()[:32]
        base = Path(self.cache_dir) / key[:2] / key
        return base.with_suffix(".flac"), base.with_suffix(".json")


def _write_clip(flac: Path, meta: Path, audio: np.ndarray, words: list[Word], params: dict) -> None:
    """Atomic writes (temp file + rename), so concurrent workers never read half a clip."""
    flac.parent.mkdir(parents=True, exist_ok=True)
    tmp = flac.with_name(f"{flac.stem}.{os.getpid()}.{threading.get_ident()}.tmp.flac")
    sf.write(tmp, np.round(audio * 32768.0).astype(np.int16), SAMPLE_RATE, format="FLAC", subtype="PCM_16")
    os.replace(tmp, flac)
    info = {"params": params, "duration": len(audio) / SAMPLE_RATE, "words": [[w.text, w.start, w.end] for w in words]}
    tmp_meta = meta.with_name(f"{meta.stem}.{os.getpid()}.{threading.get_ident()}.tmp.json")
    tmp_meta.write_text(json.dumps(info, ensure_ascii=False))
    os.replace(tmp_meta, meta)


def _read_clip(flac: Path) -> np.ndarray:
    audio, rate = sf.read(flac, dtype="int16")
    assert rate == SAMPLE_RATE, f"{flac}: {rate} Hz"
    return audio.astype(np.float32) / np.float32(32768.0)


@lru_cache(maxsize=None)
def espeak_version() -> str:
    """Version string of the bundled libespeak-ng (part of the cache key)."""
    with _lock, _Espeak() as espeak:
        espeak.lib.espeak_Info.restype = ctypes.c_char_p
        espeak.lib.espeak_Info.argtypes = [ctypes.c_void_p]
        return espeak.lib.espeak_Info(None).decode()


def measure_speed(seconds: float = 120.0, language: str = "en") -> float:
    """Seconds of audio synthesised per CPU-second (one clip of about `seconds`)."""
    start = time.process_time()
    audio, _ = synthesize_clip(12345, 0, language=language, min_seconds=seconds, max_seconds=seconds)
    return len(audio) / SAMPLE_RATE / (time.process_time() - start)
