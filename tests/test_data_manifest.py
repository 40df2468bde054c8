import json

import numpy as np
import pytest
import soundfile as sf

from wnw_exp.data import build_dataset
from wnw_exp.data.audio import AudioLoadError
from wnw_exp.data.longspeech import longspeech
from wnw_exp.data.manifest import manifest


def write_clip(path, seconds, rate=16000):
    path.parent.mkdir(parents=True, exist_ok=True)
    t = np.arange(int(seconds * rate)) / rate
    sf.write(path, (0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32), rate)


@pytest.fixture
def jsonl(tmp_path):
    for k in range(5):
        write_clip(tmp_path / "clips" / f"c{k}.flac", 0.5 + k * 0.25)
    write_clip(tmp_path / "other.wav", 1.0, rate=8000)
    records = [{"id": f"utt{k}", "audio": f"clips/c{k}.flac", "reference": f"texte {k}"} for k in range(5)]
    records.append({"audio_filepath": str(tmp_path / "other.wav"), "text": "absolute path", "language": "de"})
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_jsonl_manifest(jsonl):
    ds = manifest(jsonl)
    assert (ds.name, ds.split, len(ds)) == ("manifest", "set", 6)
    samples = list(ds)
    assert [s.id for s in samples] == ["utt0", "utt1", "utt2", "utt3", "utt4", "other"]
    assert [s.reference for s in samples[:2]] == ["texte 0", "texte 1"]
    assert [s.duration for s in samples] == pytest.approx([0.5, 0.75, 1.0, 1.25, 1.5, 1.0])
    assert samples[5].language == "de" and samples[0].language == "en"
    assert len(samples[5].audio()) == 16000  # 8 kHz resampled


def test_csv_manifest(tmp_path):
    write_clip(tmp_path / "a.wav", 1.0)
    (tmp_path / "m.csv").write_text("audio,reference,task,target_language\na.wav,bonjour,translate,fr\n")
    (s,) = list(manifest(tmp_path / "m.csv", name="mine"))
    assert (s.id, s.reference, s.task, s.target_language) == ("a", "bonjour", "translate", "fr")


def test_manifest_errors(tmp_path, jsonl):
    with pytest.raises(ValueError, match="dataset.path"):
        build_dataset({"name": "manifest", "path": None})
    with pytest.raises(FileNotFoundError, match="manifest not found"):
        manifest(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"audio": "x.wav"}\n')
    with pytest.raises(ValueError, match="record 1: no 'reference'"):
        manifest(tmp_path / "bad.jsonl")
    (tmp_path / "dup.jsonl").write_text('{"audio": "a/x.wav", "text": "1"}\n{"audio": "b/x.wav", "text": "2"}\n')
    with pytest.raises(ValueError, match="duplicate sample ids"):
        manifest(tmp_path / "dup.jsonl")
    with pytest.raises(ValueError, match="unexpected keyword"):
        build_dataset({"name": "manifest", "path": str(jsonl), "roott": "/x"})


def test_missing_audio_is_a_failed_sample_not_a_crash(tmp_path):
    (tmp_path / "m.jsonl").write_text('{"audio": "gone.flac", "reference": "x"}\n')
    (s,) = list(manifest(tmp_path / "m.jsonl"))
    assert np.isnan(s.duration)
    with pytest.raises(AudioLoadError, match="gone.flac"):
        s.audio()


def test_longspeech_subsets(tmp_path):
    for k in range(250):
        write_clip(tmp_path / "a" / f"{k}.wav", 0.05)
    lines = [json.dumps({"id": f"ls{k:03d}", "audio": f"a/{k}.wav", "reference": f"r{k}"}) for k in range(250)]
    (tmp_path / "asr_fr.jsonl").write_text("\n".join(lines))
    fr = longspeech("longspeech_asr_fr", path=tmp_path / "asr_fr.jsonl")
    assert (fr.name, fr.split, len(fr)) == ("longspeech_asr_fr", "asr-fr", 200)
    ids = [s.id for s in fr]
    assert ids == sorted(ids) and len(set(ids)) == 200  # corpus order, no repeats
    assert ids == [s.id for s in longspeech("longspeech_asr_fr", path=tmp_path / "asr_fr.jsonl")]
    assert ids != [s.id for s in longspeech("longspeech_asr_fr", path=tmp_path / "asr_fr.jsonl", seed=1)]
    s = fr[0]
    assert (s.language, s.task, s.target_language) == ("fr", "transcribe", None)
    en2fr = build_dataset({"name": "longspeech_en2fr", "path": str(tmp_path / "asr_fr.jsonl"), "n": 200, "seed": 0})
    assert (en2fr.split, len(en2fr)) == ("en2fr", 200)
    s = en2fr[0]
    assert (s.language, s.task, s.target_language) == ("en", "translate", "fr")


def test_longspeech_missing_path(monkeypatch):
    monkeypatch.delenv("WNW_LONGSPEECH_EN2FR", raising=False)
    with pytest.raises(ValueError, match="WNW_LONGSPEECH_EN2FR"):
        build_dataset({"name": "longspeech_en2fr", "path": None})
