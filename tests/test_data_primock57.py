import numpy as np
import pytest
import soundfile as sf

from wnw_exp.data import build_dataset
from wnw_exp.data.audio import AudioLoadError
from wnw_exp.data.primock57 import merged_reference, primock57, strip_tags


def textgrid(tier, xmax, intervals):
    """A TextGrid in the long text format PriMock57 ships (note the trailing spaces)."""
    filled, t = [], 0.0
    for start, end, text in intervals:  # gaps become empty intervals, as in the corpus
        if start > t:
            filled.append((t, start, ""))
        filled.append((start, end, text))
        t = end
    if t < xmax:
        filled.append((t, xmax, ""))
    lines = [
        'File type = "ooTextFile"', 'Object class = "TextGrid"', "",
        "xmin = 0 ", f"xmax = {xmax} ", "tiers? <exists> ", "size = 1 ", "item []: ",
        "    item [1]:", '        class = "IntervalTier" ', f'        name = "{tier}" ',
        "        xmin = 0 ", f"        xmax = {xmax} ", f"        intervals: size = {len(filled)} ",
    ]  # fmt: skip
    for k, (a, b, text) in enumerate(filled, 1):
        lines += [f"        intervals [{k}]:", f"            xmin = {a} ", f"            xmax = {b} ",
                  f'            text = "{text}" ']  # fmt: skip
    return "\n".join(lines) + "\n"


def write_consultation(root, stem, seconds, doctor, patient, amp=0.9):
    (root / "audio").mkdir(parents=True, exist_ok=True)
    (root / "transcripts").mkdir(parents=True, exist_ok=True)
    t = np.arange(int(seconds * 16000)) / 16000
    for speaker, freq, utts in (("doctor", 200, doctor), ("patient", 300, patient)):
        x = (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)
        sf.write(root / "audio" / f"{stem}_{speaker}.wav", x, 16000, subtype="PCM_16")
        (root / "transcripts" / f"{stem}_{speaker}.TextGrid").write_text(textgrid(speaker.title(), seconds, utts))


@pytest.fixture
def root(tmp_path):
    write_consultation(
        tmp_path, "day1_consultation10", 4.0,
        doctor=[(0.5, 1.0, "Hello, how can I help?"), (2.0, 2.5, "I see. <UNSURE>Any</UNSURE> fever?")],
        patient=[(1.2, 1.8, "<UNSURE>Oh</UNSURE> <UNSURE>hey</UNSURE>, um, I've a cough."),
                 (2.6, 3.0, "<UNIN/>"), (3.1, 3.5, "No <INAUDIBLE_SPEECH/> fever.")],
    )  # fmt: skip
    write_consultation(tmp_path, "day1_consultation02", 2.0, doctor=[(0.1, 0.5, "Hi.")], patient=[(0.1, 0.6, "Hello.")])
    write_consultation(tmp_path, "day2_consultation01", 1.0, doctor=[(0.0, 0.5, "Bye.")], patient=[])
    return tmp_path


def test_count_order_ids_and_durations(root):
    ds = primock57(root=root)
    assert (ds.name, len(ds)) == ("primock57", 3)
    samples = list(ds)
    assert [s.id for s in samples] == ["day1_consultation02", "day1_consultation10", "day2_consultation01"]
    assert [s.duration for s in samples] == pytest.approx([2.0, 4.0, 1.0])


def test_reference_merges_tiers_in_time_order_and_strips_tags(root):
    s = primock57(root=root)[1]
    assert s.reference == (
        "Hello, how can I help? Oh hey, um, I've a cough. I see. Any fever? No fever."
    )
    assert "Doctor" not in s.reference and "<" not in s.reference
    # equal start times: doctor first
    assert primock57(root=root)[0].reference == "Hi. Hello."
    assert strip_tags("So <UNIN/> in my  <UNSURE>lower</UNSURE> abdomen") == "So in my lower abdomen"


def test_audio_is_the_average_of_both_channels(root):
    s = primock57(root=root)[1]
    audio = s.audio()
    assert len(audio) == 4 * 16000 and audio.dtype == np.float32
    assert np.abs(audio).max() <= 1.0
    t = np.arange(4 * 16000) / 16000
    expected = 0.9 * (np.sin(2 * np.pi * 200 * t) + np.sin(2 * np.pi * 300 * t)) / 2
    np.testing.assert_allclose(audio, expected, atol=2e-4)


def test_subsampling_and_build_dataset(root, monkeypatch):
    monkeypatch.setenv("WNW_PRIMOCK57", str(root))
    ds = build_dataset({"name": "primock57", "root": None, "n": 2, "seed": 1})
    again = build_dataset({"name": "primock57", "root": None, "n": 2, "seed": 1})
    assert [s.id for s in ds] == [s.id for s in again] and len(ds) == 2


def test_errors(root, tmp_path, monkeypatch):
    monkeypatch.delenv("WNW_PRIMOCK57", raising=False)
    with pytest.raises(ValueError, match="primock57.*WNW_PRIMOCK57"):
        primock57(root=None)
    with pytest.raises(FileNotFoundError, match="audio/ and transcripts/"):
        primock57(root=tmp_path / "audio")
    (root / "audio" / "day1_consultation02_patient.wav").unlink()
    with pytest.raises(FileNotFoundError, match="day1_consultation02_patient.wav"):
        primock57(root=root)


def test_corrupt_wav_fails_lazily(root):
    (root / "audio" / "day2_consultation01_patient.wav").write_bytes(b"RIFF....WAVEjunk")
    s = primock57(root=root)[2]
    assert np.isnan(s.duration)
    with pytest.raises(AudioLoadError, match="day2_consultation01_patient.wav"):
        s.audio()


def test_merged_reference_reads_real_format_files(root):
    t = root / "transcripts"
    assert merged_reference(t / "day2_consultation01_doctor.TextGrid", t / "day2_consultation01_patient.TextGrid") == "Bye."
