"""Bad input gets one clear error, and finished work survives (issue 8/8)."""

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

from wnw_exp.backbones import WeightsNotFoundError
from wnw_exp.rundir import read_predictions
from wnw_exp.engine.runner import run
from wnw_exp.paths import conf_dir

CONF = str(conf_dir())


def config(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=list(overrides)), resolve=True)


@pytest.fixture
def finished_run(tmp_path):
    """A run directory holding one finished sample, which no failure below may touch."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "predictions.jsonl").write_text(json.dumps({"id": "done-0", "hypothesis": "a", "reference": "a"}) + "\n")
    return d


def assert_untouched(run_dir):
    assert (run_dir / "predictions.jsonl").read_text().count("\n") == 1


def _voxtral_folder(tmp_path, model_type="voxtral"):
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


def test_missing_weights_folder(tmp_path, finished_run):
    with pytest.raises(WeightsNotFoundError, match="does not exist.*model.path"):
        run(config("model=voxtral", f"model.path={tmp_path / 'nope'}"), finished_run, progress=False)
    assert_untouched(finished_run)


def test_partial_weights_folder(tmp_path, finished_run):
    folder = _voxtral_folder(tmp_path)
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(WeightsNotFoundError, match="partial: 1 of 2 shards are missing"):
        run(config("model=voxtral", f"model.path={folder}"), finished_run, progress=False)
    assert_untouched(finished_run)


def test_truncated_weights_file(tmp_path, finished_run):
    folder = _voxtral_folder(tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(WeightsNotFoundError, match="could not load the weights of model voxtral"):
        run(config("model=voxtral", f"model.path={folder}"), finished_run, progress=False)


def test_weights_of_another_architecture(tmp_path, finished_run):
    folder = _voxtral_folder(tmp_path, model_type="llama")
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="a 'llama' model, not voxtral"):
        run(config("model=voxtral", f"model.path={folder}"), finished_run, progress=False)
    assert_untouched(finished_run)


def test_data_root_that_does_not_exist(tmp_path, finished_run):
    with pytest.raises(FileNotFoundError, match="librispeech"):
        run(config("model=tiny_random", "dataset=librispeech_long", f"dataset.root={tmp_path / 'none'}"),
            finished_run, progress=False)
    assert_untouched(finished_run)


@pytest.mark.parametrize("retention", ["0", "-0.2", "1.01"])
def test_retention_outside_unit_interval(retention, finished_run):
    with pytest.raises(ValueError, match="outside \\(0, 1\\]"):
        run(config("model=tiny_random", f"retention={retention}"), finished_run, progress=False)
    assert_untouched(finished_run)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu(finished_run):
    with pytest.raises(RuntimeError, match="no CUDA GPU is visible; use device=cpu"):
        run(config("model=tiny_random", "device=cuda"), finished_run, progress=False)
    assert_untouched(finished_run)


@pytest.mark.parametrize("group,name,choice", [("model", "voxtral_mini", "voxtral_small"),
                                               ("method", "snapkv", "full"),
                                               ("dataset", "librispeech", "librispeech_long")])
def test_unknown_names_list_the_choices(group, name, choice):
    with pytest.raises(MissingConfigException) as e:
        config(f"{group}={name}")
    assert f"Available options in '{group}'" in str(e.value) and choice in str(e.value)


def test_bad_audio_files_fail_their_sample_and_the_run_goes_on(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    rng = np.random.RandomState(0)
    sf.write(d / "good.wav", (rng.randn(16000 * 3) * 0.1).astype(np.float32), 16000)
    sf.write(d / "silent.wav", np.zeros(16000 * 2, dtype=np.float32), 16000)
    sf.write(d / "short.flac", (rng.randn(800) * 0.1).astype(np.float32), 16000)  # 50 ms
    (d / "corrupt.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk")
    sf.write(d / "empty.wav", np.zeros(0, dtype=np.float32), 16000)
    (d / "text.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really audio")
    names = ["good.wav", "corrupt.wav", "silent.wav", "empty.wav", "text.mp4", "short.flac"]
    manifest = d / "m.jsonl"
    manifest.write_text("".join(json.dumps({"audio": n, "reference": "one two"}) + "\n" for n in names))
    metrics = run(config("model=tiny_random", "dataset=manifest", f"dataset.path={manifest}"), tmp_path / "run",
                  progress=False)
    by_id = {r["id"]: r for r in read_predictions(tmp_path / "run")}
    assert list(by_id) == [Path(n).stem for n in names]
    for ok in ["good", "silent", "short"]:
        assert by_id[ok]["error"] is None and by_id[ok]["n_new_tokens"] > 0
    for bad in ["corrupt", "empty", "text"]:
        assert by_id[bad]["error"], bad
    assert "corrupt.wav" in by_id["corrupt"]["error"] and "no samples" in by_id["empty"]["error"]
    assert metrics["n_failed"] == 3 and metrics["n_samples"] == 6


def test_out_of_memory_fails_one_sample_and_the_run_goes_on(tmp_path, monkeypatch):
    import wnw_exp.engine.runner as runner

    real, calls = runner.generate, []

    def oom_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "generate", oom_once)
    metrics = run(config("model=tiny_random", "dataset.n=2", "dataset.min_seconds=3", "dataset.max_seconds=4",
                         f"dataset.cache_dir={tmp_path / 'cache'}"), tmp_path / "run", progress=False)
    records = read_predictions(tmp_path / "run")
    assert records[0]["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert records[1]["error"] is None and metrics["n_failed"] == 1


def test_the_cli_prints_one_line_and_exits_2(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "wnw_exp.cli.run", "retention=2", f"runs_root={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "wnw-run: error: retention=2 is outside (0, 1]: it is the fraction of audio KV kept on the device"]


@pytest.mark.parametrize("override,message", [
    ("method.n_voice=13", r"n_voice=13 is outside \[0, 12\] \(the model has 12 KV heads\)"),
    ("method.n_voice=most", r"method.n_voice='most': auto \(§3.4\), all \(every KV head a voice head\) or a number"),
    ("method.chunk_seconds=0.05", "shorter than one audio token"),
])
def test_impossible_wnw_settings_are_refused_before_any_sample(override, message, finished_run):
    with pytest.raises(ValueError, match=message):
        run(config("model=tiny_random", "method=wnw", override), finished_run, progress=False)
    assert_untouched(finished_run)


def test_head_scores_of_another_model_are_refused(tmp_path, finished_run):
    from wnw_exp.head_scores import HeadScoresError

    shipped = Path(__file__).resolve().parents[1] / "src/wnw_exp/calibration/shipped/tiny_random.json"
    other = json.loads(shipped.read_text())
    other["model"] = "voxtral"
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(HeadScoresError, match="voxtral"):
        run(config("model=tiny_random", "method=wnw", f"method.head_scores={tmp_path / 'other.json'}"),
            finished_run, progress=False)
    layout = json.loads(shipped.read_text())
    layout["n_kv_heads"] = 8
    (tmp_path / "layout.json").write_text(json.dumps(layout))
    with pytest.raises(HeadScoresError):
        run(config("model=tiny_random", "method=wnw", f"method.head_scores={tmp_path / 'layout.json'}"),
            finished_run, progress=False)
    assert_untouched(finished_run)
