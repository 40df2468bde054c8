"""The training mixture of `wnw-train-projector train`: voices, text domains and augmentation (off by default)."""

import numpy as np
import pytest

from wnw_exp.data import voices as V
from wnw_exp.data.base import SAMPLE_RATE
from wnw_exp.data.synthetic import clip_voice, synthesize_clip
from wnw_exp.train.augment import Augment, parse
from wnw_exp.train.projector import TRAIN_SEED, NaturalClips, main

STAGES = ((1.0, 4.0, 6.0),)


def test_defaults_are_the_shipped_recipe():
    clips = NaturalClips(None, 0, 0, None, STAGES, 8)
    assert clips.voices == V.SIX["en"] and clips.rate_range == (150, 200) and clips.augment is None
    audio, words, timed = clips.clip(3, 4.0, 6.0)
    ref, ref_words = synthesize_clip(TRAIN_SEED, 3, text="natural", text_split="train", voices=V.SIX["en"],
                                     min_seconds=4.0, max_seconds=6.0)
    assert timed and words == ref_words and audio.tobytes() == ref.tobytes()
    assert parse(None) is None and parse("off") is None


def test_wide_voices_and_text_domains_per_clip():
    clips = NaturalClips(None, 5, 0, None, STAGES, 8, voices="train_wide", texts=("natural", "random"))
    names = V.PRESETS["train_wide"][0]
    assert clips.rate_range == (120, 230)
    assert {clips.text_of(i) for i in range(40)} == {"natural", "random"}
    for index in range(2):
        audio, words, timed = clips.clip(index, 4.0, 6.0)
        voice = clip_voice(TRAIN_SEED + 5, index, "train_wide")
        assert voice in names and timed
        ref, _ = synthesize_clip(TRAIN_SEED + 5, index, text=clips.text_of(index), text_split="train",
                                 voices=[voice] * len(names), rate_range=(120, 230), min_seconds=4.0, max_seconds=6.0)
        assert audio.tobytes() == ref.tobytes()


def test_a_share_of_the_clips_keeps_the_six_voices():
    """`six_share`: about that share of the clips is spoken by the six voices at their rates (the shipped recipe's
    clip, byte for byte), the others by the wide preset; 0 draws none."""
    clips = NaturalClips(None, 5, 0, None, STAGES, 8, voices="train_wide", six_share=0.3)
    picks = [clips.speakers_of(i) for i in range(400)]
    six = [i for i, (v, _) in enumerate(picks) if v == V.SIX["en"]]
    assert 0.22 < len(six) / 400 < 0.38
    assert all(r == (120, 230) and v == V.PRESETS["train_wide"][0] for i, (v, r) in enumerate(picks) if i not in six)
    index = six[0]
    audio, words, timed = clips.clip(index, 4.0, 6.0)
    ref, ref_words = synthesize_clip(TRAIN_SEED + 5, index, text="natural", text_split="train", voices=V.SIX["en"],
                                     rate_range=(150, 200), min_seconds=4.0, max_seconds=6.0)
    assert timed and words == ref_words and audio.tobytes() == ref.tobytes()
    none = NaturalClips(None, 5, 0, None, STAGES, 8, voices="train_wide")
    assert all(none.speakers_of(i)[0] == V.PRESETS["train_wide"][0] for i in range(50))


def test_augmentation_is_deterministic_under_its_seed_and_moves_the_word_times():
    pytest.importorskip("pedalboard")
    from wnw_exp.train.augment import augment

    audio, words = synthesize_clip(TRAIN_SEED, 0, text="natural", text_split="train", min_seconds=4, max_seconds=6)
    aug = Augment(speed=(1.2, 1.2), gain_db=(0.0, 0.0), reverb_p=0.0, noise_p=0.0)
    fast, fast_words = augment(audio, words, aug, np.random.default_rng(0))
    assert len(fast) == pytest.approx(len(audio) / 1.2, abs=2)
    assert [w.start for w in fast_words] == pytest.approx([w.start / 1.2 for w in words], abs=1e-4)
    # the same speech, faster: the correlation with the clip resampled independently (np.interp) is high
    ref = np.interp(np.arange(len(fast)) * 1.2, np.arange(len(audio)), audio)
    assert np.corrcoef(fast, ref)[0, 1] > 0.9
    light = parse("light")
    a, wa = augment(audio, words, light, np.random.default_rng([7, 3, 3]))
    b, wb = augment(audio, words, light, np.random.default_rng([7, 3, 3]))
    c, _ = augment(audio, words, light, np.random.default_rng([7, 4, 3]))
    assert a.tobytes() == b.tobytes() and wa == wb
    assert a.shape != c.shape or a.tobytes() != c.tobytes()
    assert np.array_equal(np.round(a * 32768), a * 32768) and np.abs(a).max() <= 1.0
    noisy, _ = augment(audio, words, Augment(speed=(1, 1), gain_db=(0, 0), reverb_p=0, noise_p=1,
                                             noise_snr_db=(20, 20)), np.random.default_rng(1))
    snr = 10 * np.log10(np.mean(audio.astype(np.float64) ** 2) / np.mean((noisy - audio).astype(np.float64) ** 2))
    assert snr == pytest.approx(20, abs=0.5)
    clips = NaturalClips(None, 0, 0, None, STAGES, 8, augment=light)
    x, xw, _ = clips.clip(2, 4.0, 6.0)
    y, yw, _ = NaturalClips(None, 0, 0, None, STAGES, 8, augment=light).clip(2, 4.0, 6.0)
    assert x.tobytes() == y.tobytes() and xw == yw and len(x) / SAMPLE_RATE < 7


def test_bad_options_are_one_clear_line(capsys):
    for argv, message in ((["--voices", "wide"], "no voice 'wide'"), (["--texts", "poems"], "choose among"),
                          (["--augment", "heavy"], "give off, light"), (["--augment", '{"speed": [1.2, 0.9]}'],
                                                                         "need min <= max"),
                          (["--rate-range", "200"], "MIN,MAX"), (["--six-share", "1.5"], "fraction in [0, 1]")):
        with pytest.raises(SystemExit):
            main(["train", "--run-dir", "unused", *argv])
        assert message in capsys.readouterr().err
