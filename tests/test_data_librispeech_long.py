import numpy as np
import pytest
import soundfile as sf

from wnw_exp.data import build_dataset
from wnw_exp.data.audio import AudioLoadError
from wnw_exp.data.librispeech_long import CALIBRATION, librispeech_long


def write_recording(folder, speaker, chapter, segment, seconds, text):
    d = folder / str(speaker) / str(chapter)
    d.mkdir(parents=True, exist_ok=True)
    t = np.arange(int(seconds * 16000)) / 16000
    sf.write(d / f"{chapter}_{segment:04d}.flac", (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16000)
    (d / f"{chapter}_{segment:04d}.txt").write_text(text)  # one line, no newline, as released


@pytest.fixture
def root(tmp_path):
    """<tmp>/librispeech-long/<split>/<speaker>/<chapter>/<chapter>_<segment>.{flac,txt}"""
    base = tmp_path / "librispeech-long"
    tc = base / "test-clean"
    write_recording(tc, 1272, 128104, 10, 1.5, "THIRD ONE")
    write_recording(tc, 1272, 128104, 0, 1.0, "FIRST ONE")
    write_recording(tc, 1272, 128104, 1, 2.0, "SECOND ONE")
    write_recording(tc, 84, 121123, 0, 0.5, "SPEAKER EIGHTY FOUR")  # 84 < 1272 numerically
    for k in range(3):
        write_recording(base / "test-other", 367, 130732, k, 0.2, f"OTHER {k}")
    for k in range(60):
        write_recording(base / "dev-clean", 2412 + k % 4, 153947 + k % 2, k, 0.1, f"DEV {k}")
    return tmp_path


def test_count_order_ids_references_durations(root):
    ds = librispeech_long(root=root, split="test-clean")
    assert (ds.name, ds.split, len(ds)) == ("librispeech_long", "test-clean", 4)
    samples = list(ds)
    assert [s.id for s in samples] == ["84-121123-0000", "1272-128104-0000", "1272-128104-0001", "1272-128104-0010"]
    assert [s.reference for s in samples] == ["SPEAKER EIGHTY FOUR", "FIRST ONE", "SECOND ONE", "THIRD ONE"]
    assert [s.duration for s in samples] == pytest.approx([0.5, 1.0, 2.0, 1.5])
    audio = samples[2].audio()
    assert audio.dtype == np.float32 and len(audio) == 32000
    assert samples[0].language == "en" and samples[0].task == "transcribe"


def test_root_may_be_the_unpacked_folder_itself(root):
    ds = librispeech_long(root=root / "librispeech-long", split="test-other")
    assert [s.id for s in ds] == ["367-130732-0000", "367-130732-0001", "367-130732-0002"]


def test_calibration_subset_is_deterministic_and_disjoint_from_tests(root):
    calib = librispeech_long(root=root, **CALIBRATION)
    assert CALIBRATION == {"split": "dev-clean", "n": 50, "seed": 0}
    ids = [s.id for s in calib]
    assert len(ids) == len(set(ids)) == 50
    assert ids == [s.id for s in librispeech_long(root=root, split="dev-clean", n=50, seed=0)]
    assert ids != [s.id for s in librispeech_long(root=root, split="dev-clean", n=50, seed=1)]
    all_dev = [s.id for s in librispeech_long(root=root, split="dev-clean")]
    assert ids == [i for i in all_dev if i in set(ids)]  # corpus order kept
    test_ids = {s.id for split in ("test-clean", "test-other") for s in librispeech_long(root=root, split=split)}
    assert not set(ids) & test_ids
    calib_audio = {str(e.audio) for e in calib.entries}
    test_audio = {str(e.audio) for split in ("test-clean", "test-other") for e in librispeech_long(root=root, split=split).entries}
    assert not calib_audio & test_audio


def test_shards_partition_the_selection(root):
    full = [s.id for s in librispeech_long(root=root, split="dev-clean", n=10, seed=3)]
    parts = [[s.id for s in librispeech_long(root=root, split="dev-clean", n=10, seed=3, shard=k, num_shards=3)] for k in range(3)]
    assert parts[0] == full[0::3] and parts[1] == full[1::3] and parts[2] == full[2::3]


def test_missing_root_names_the_download(tmp_path, monkeypatch):
    monkeypatch.delenv("WNW_LIBRISPEECH_LONG", raising=False)
    with pytest.raises(ValueError, match="librispeech_long/v0_1.tar.gz.*WNW_LIBRISPEECH_LONG"):
        librispeech_long(root=None)
    with pytest.raises(FileNotFoundError, match=r"not found at .*nowhere.*v0_1\.tar\.gz"):
        librispeech_long(root=tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="test-clean"):
        librispeech_long(root=tmp_path)  # exists but has no split folder
    with pytest.raises(ValueError, match="split"):
        librispeech_long(root=tmp_path, split="train-clean-100")


def test_env_root_and_build_dataset(root, monkeypatch):
    monkeypatch.setenv("WNW_LIBRISPEECH_LONG", str(root))
    ds = build_dataset({"name": "librispeech_long", "root": None, "split": "test-clean", "n": 2, "seed": 0})
    assert len(ds) == 2 and ds.name == "librispeech_long"


def test_corrupt_file_fails_lazily(root):
    bad = root / "librispeech-long" / "test-clean" / "84" / "121123" / "121123_0000.flac"
    bad.write_bytes(b"not a flac file at all")
    samples = list(librispeech_long(root=root, split="test-clean"))  # building does not crash
    assert np.isnan(samples[0].duration)
    with pytest.raises(AudioLoadError, match="121123_0000.flac"):
        samples[0].audio()
    assert len(samples[1].audio()) == 16000


def test_wnw_run_on_a_generated_tree_end_to_end(root):
    """`wnw-run dataset=librispeech_long dataset.root=<tree> model=tiny_random dataset.n=2`."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, WNW_NO_PROGRESS="1")
    out = subprocess.run([sys.executable, "-m", "wnw_exp.cli.run", "dataset=librispeech_long",
                          f"dataset.root={root}", "model=tiny_random", "dataset.n=2",
                          f"runs_root={root / 'runs'}"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (run_dir,) = (root / "runs" / "tiny_random" / "librispeech_long-test-clean" / "wnw" / "r0.2").glob("cfg-*")
    records = [json.loads(x) for x in (run_dir / "predictions.jsonl").read_text().splitlines()]
    expected = list(librispeech_long(root=str(root), split="test-clean", n=2, seed=0))  # the seeded sub-sample
    assert [r["id"] for r in records] == [s.id for s in expected]
    assert [r["reference"] for r in records] == [s.reference for s in expected]
    assert all(r["error"] is None for r in records)
    assert json.loads((run_dir / "metrics.json").read_text())["n_samples"] == 2
