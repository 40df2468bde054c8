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


@pytest.mark.parametrize("given,task", [("asr", "transcribe"), ("Transcription", "transcribe"), ("ast", "translate"),
                                        ("st", "translate"), ("translation", "translate")])
def test_task_aliases(tmp_path, given, task):
    write_clip(tmp_path / "a.wav", 0.5)
    (tmp_path / "m.jsonl").write_text(json.dumps({"audio": "a.wav", "reference": "x", "task": given}) + "\n")
    assert manifest(tmp_path / "m.jsonl")[0].task == task
    assert manifest(tmp_path / "m.jsonl", task=given)[0].task == task  # dataset.task takes them too
    (tmp_path / "bad.jsonl").write_text(json.dumps({"audio": "a.wav", "reference": "x", "task": "summarise"}) + "\n")
    with pytest.raises(ValueError, match="record 1: task must be transcribe .* got 'summarise'"):
        manifest(tmp_path / "bad.jsonl")


@pytest.mark.parametrize("reference", ["", "   "])
def test_an_empty_reference_is_named_as_such(tmp_path, reference):
    (tmp_path / "m.jsonl").write_text(json.dumps({"audio": "a.wav", "text": reference}) + "\n")
    with pytest.raises(ValueError, match="m.jsonl record 1: the 'text' field is empty"):
        manifest(tmp_path / "m.jsonl")


def test_the_audio_header_decides_the_duration_not_the_manifest(tmp_path):
    write_clip(tmp_path / "a.wav", 2.0)
    (tmp_path / "m.jsonl").write_text(json.dumps({"audio": "a.wav", "reference": "x", "duration": 5}) + "\n")
    assert manifest(tmp_path / "m.jsonl")[0].duration == pytest.approx(2.0)


@pytest.mark.parametrize("text,line,message", [
    ('[{"audio": "a.wav", "reference": "x"}, {"audio": "b.wav", "reference": "y"}]\n', 1, "a JSON array"),
    ('[\n  {"audio": "a.wav", "reference": "x"}\n]\n', 1, "a JSON array"),  # indented
    ('{"audio": "a.wav", "reference": "x"}\n"b.wav"\n', 2, "'\"b.wav\"', not a JSON object"),
])
def test_json_that_is_not_jsonl_names_the_file_and_line(tmp_path, text, line, message):
    (tmp_path / "m.jsonl").write_text(text)
    with pytest.raises(ValueError) as e:
        manifest(tmp_path / "m.jsonl")
    assert str(e.value).startswith(f"{tmp_path / 'm.jsonl'}:{line}: ") and message in str(e.value)
    assert "one JSON object per line" in str(e.value)


@pytest.mark.parametrize("name,line", [("m.jsonl", 2), ("m.csv", 3)])
def test_a_manifest_that_is_not_utf8_names_the_file_and_line(tmp_path, name, line):
    rows = ('{"audio": "a.wav", "reference": "x"}\n{"audio": "b.wav", "reference": "caf\xe9"}\n' if name.endswith("l")
            else "audio,reference\na.wav,x\nb.wav,caf\xe9\n")
    (tmp_path / name).write_bytes(rows.encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{name}:{line}: not UTF-8 text \(byte 0xe9 at column \d+\): save the manifest "
                                         "as UTF-8"):
        manifest(tmp_path / name)
    (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + rows.encode("utf-8"))  # UTF-8 with a BOM is fine
    assert [s.reference for s in manifest(tmp_path / name)] == ["x", "café"]


def test_an_empty_manifest_is_refused(tmp_path):
    (tmp_path / "m.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="m.jsonl holds no records"):
        manifest(tmp_path / "m.jsonl")
