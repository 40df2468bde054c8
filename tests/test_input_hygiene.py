"""Bad input never slips through (issue 14, point 3): the audio header decides a recording's length and the
over-length refusal names the real limit; NaN/Inf audio fails its sample; a selection of zero samples is an
error. Every input is a real file."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from wnw_exp.rundir import read_predictions
from wnw_exp.engine.runner import run
from wnw_exp.paths import conf_dir

CONF = str(conf_dir())


def config(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=["model=tiny_random", "method=full", *overrides]),
                                      resolve=True)


def manifest_of(folder: Path, records: list[dict]) -> Path:
    path = folder / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_header_decides_the_length_and_the_refusal_names_the_real_limit(tmp_path, monkeypatch):
    # 2000 s of audio at 100 Hz (400 kB on disk); the manifest calls it 5 s
    sf.write(tmp_path / "long.wav", np.zeros(200_000, np.float32), 100, subtype="PCM_16")
    sf.write(tmp_path / "ok.wav", (np.random.RandomState(0).randn(16000) * 0.1).astype(np.float32), 16000)
    path = manifest_of(tmp_path, [{"audio": "long.wav", "reference": "a b", "duration": 5},
                                  {"audio": "ok.wav", "reference": "a b"}])
    manifest_module = sys.modules["wnw_exp.data.manifest"]  # the module (wnw_exp.data.manifest is the reader)
    decoded = []
    real_load = manifest_module.load_audio
    monkeypatch.setattr(manifest_module, "load_audio", lambda p: decoded.append(Path(p).name) or real_load(p))
    metrics = run(config("dataset=manifest", f"dataset.path={path}"), tmp_path / "run", progress=False)
    long, ok = read_predictions(tmp_path / "run")
    assert long["duration"] == pytest.approx(2000.0) and decoded == ["ok.wav"]  # the long file was never decoded
    limit = float(long["error"].split("the limit is about ")[1].split(" s")[0])
    # tiny_random: audio in whole 30 s windows of 375 tokens, an answer cap of 4 tokens/s + 8, a 256-token prompt
    # allowance, 16384 positions: 960 s fit (32 * 375 + 3840 + 8 + 256 = 16104), 960.1 s take a 33rd window
    assert limit == 960
    assert long["error"].startswith("ValueError: audio of 2000 s and its answer need more than the 16384 positions")
    assert ok["error"] is None and metrics["n_failed"] == 1


def test_nan_or_inf_audio_fails_its_sample_with_the_reason(tmp_path):
    audio = (np.random.RandomState(0).randn(16000) * 0.1).astype(np.float32)
    for name, bad in [("nan", np.nan), ("inf", np.inf)]:
        x = audio.copy()
        x[100:103] = bad
        sf.write(tmp_path / f"{name}.wav", x, 16000, subtype="FLOAT")
    sf.write(tmp_path / "good.wav", audio, 16000, subtype="FLOAT")
    path = manifest_of(tmp_path, [{"audio": f"{n}.wav", "reference": "a b"} for n in ("nan", "good", "inf")])
    metrics = run(config("dataset=manifest", f"dataset.path={path}"), tmp_path / "run", progress=False)
    by_id = {r["id"]: r for r in read_predictions(tmp_path / "run")}
    for name in ("nan", "inf"):
        assert by_id[name]["error"].startswith("ValueError: the audio holds 3 NaN or infinite values (of 16000")
        assert by_id[name]["hypothesis"] == ""
    assert by_id["good"]["error"] is None and metrics["n_failed"] == 2 and metrics["n_samples"] == 3


@pytest.fixture
def one_clip_manifest(tmp_path):
    sf.write(tmp_path / "a.wav", np.zeros(8000, np.float32), 16000)
    return manifest_of(tmp_path, [{"audio": "a.wav", "reference": "a"}])


@pytest.mark.parametrize("overrides,message", [
    (["dataset.n=0"], "dataset.n=0 selects no sample"),
    (["dataset.n=-1"], "dataset.n=-1 selects no sample"),
    (["dataset.shard=2", "dataset.num_shards=2"], r"dataset.shard=2 is outside 0..1 \(dataset.num_shards=2\)"),
    (["dataset=manifest", "dataset.num_shards=2", "dataset.shard=1"],
     "dataset.shard=1 selects no sample: 1 samples make fewer than dataset.num_shards=2 shards"),
    (["dataset=manifest", "dataset.n=0"], "dataset.n=0 selects no sample: use n >= 1, or n=null for all"),
])
def test_zero_selected_samples_is_an_error(overrides, message, one_clip_manifest, tmp_path):
    with pytest.raises(ValueError, match=message):
        run(config(*overrides, f"dataset.path={one_clip_manifest}") if "dataset=manifest" in overrides
            else config(*overrides), tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "predictions.jsonl").exists() and not (tmp_path / "run" / "metrics.json").exists()


def test_an_empty_manifest_exits_2_with_one_line(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    env = dict(os.environ, WNW_NO_PROGRESS="1")
    out = subprocess.run([sys.executable, "-m", "wnw_exp.cli.run", "model=tiny_random", "dataset=manifest",
                          f"dataset.path={tmp_path / 'empty.jsonl'}", f"runs_root={tmp_path / 'runs'}"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [f"wnw-run: error: {tmp_path / 'empty.jsonl'} holds no records: write one JSON "
                                       "object (audio, reference) per line"]
