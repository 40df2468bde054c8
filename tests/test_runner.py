"""wnw-run end to end on tiny_random: run directory contract, resume, sweeps, clear errors."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from wnw_exp.backbones import WeightsNotFoundError, load_backbone
from wnw_exp.rundir import read_predictions
from wnw_exp.engine.runner import run
from wnw_exp.paths import conf_dir

CONF = str(conf_dir())
SHORT = ["model=tiny_random", "method=full", "dataset.min_seconds=3", "dataset.max_seconds=5"]


def config(tmp_path, *overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=[*SHORT, f"dataset.cache_dir={tmp_path / 'cache'}", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def test_run_writes_the_run_directory(tmp_path):
    cfg = config(tmp_path, "dataset.n=2")
    metrics = run(cfg, tmp_path / "run", progress=False)
    records = read_predictions(tmp_path / "run")
    assert [r["id"] for r in records] == ["synthetic-test-0", "synthetic-test-1"]
    for key in ["id", "hypothesis", "reference", "n_new_tokens", "terminated", "r_gpu", "r_gpu_cpu",
                "ms_per_token", "mb_per_step", "error"]:
        assert key in records[0]
    on_disk = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert on_disk == metrics
    for key in ["wer", "r_gpu", "r_gpu_cpu", "ms_per_token", "terminated_rate", "n_samples"]:
        assert metrics[key] is not None
    assert metrics["n_samples"] == 2 and metrics["n_selected"] == 2 and metrics["r_gpu"] == 1.0
    trace = json.loads((tmp_path / "run" / "trace" / "synthetic-test-0.json").read_text())
    assert len(trace["gpu_audio_tokens"]) == records[0]["n_new_tokens"] - 1
    env = json.loads((tmp_path / "run" / "environment.json").read_text())
    assert {"wnw_exp", "git_commit", "torch", "transformers", "device"} <= env.keys()


def test_resume_skips_finished_samples_and_recomputes_a_torn_line(tmp_path, monkeypatch):
    cfg = config(tmp_path, "dataset.n=3")
    run_dir = tmp_path / "run"
    run({**cfg, "dataset": {**cfg["dataset"], "n": 1}}, run_dir, progress=False)
    first = (run_dir / "predictions.jsonl").read_text()
    # a run killed while writing its second sample leaves a torn line
    with open(run_dir / "predictions.jsonl", "a") as f:
        f.write('{"id": "synthetic-test-1", "hypo')
    metrics = run(cfg, run_dir, progress=False)
    lines = (run_dir / "predictions.jsonl").read_text().splitlines()
    ids = [json.loads(x)["id"] for x in lines]
    assert ids == ["synthetic-test-0", "synthetic-test-1", "synthetic-test-2"]
    assert lines[0] + "\n" == first  # the finished sample was not recomputed
    history = json.loads((run_dir / "environment.json").read_text())["history"]
    assert [x["samples_before"] for x in history] == [0, 1]  # the two wnw-runs that computed samples
    # a finished run re-run: metrics again, no model loaded, nothing added to the history
    import wnw_exp.engine.runner as runner

    def no_model(*a, **k):
        raise AssertionError("a finished run loaded a model")

    monkeypatch.setattr(runner, "load_backbone", no_model)
    assert run(cfg, run_dir, progress=False) == metrics
    assert len(json.loads((run_dir / "environment.json").read_text())["history"]) == 2
    assert metrics["n_samples"] == 3
    # re-running the same command is a no-op
    run(cfg, run_dir, progress=False)
    assert (run_dir / "predictions.jsonl").read_text().splitlines() == lines


def test_a_failing_sample_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    from wnw_exp.data.synthetic import SyntheticDataset

    original = SyntheticDataset.__getitem__

    def broken(self, i):
        sample = original(self, i)
        if i == 0:
            def fail():
                raise OSError("cannot read audio file")
            sample.load_audio = fail
        return sample

    monkeypatch.setattr(SyntheticDataset, "__getitem__", broken)
    metrics = run(config(tmp_path, "dataset.n=2"), tmp_path / "run", progress=False)
    records = read_predictions(tmp_path / "run")
    assert records[0]["error"].startswith("OSError: cannot read audio file")
    assert records[1]["error"] is None
    assert metrics["n_failed"] == 1 and metrics["n_samples"] == 2


def test_retention_outside_unit_interval_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"retention=1.5 is outside \(0, 1\]"):
        run(config(tmp_path, "retention=1.5"), tmp_path / "run", progress=False)


@pytest.mark.parametrize("cfg", [
    dict(name="voxtral", family="voxtral", repo_id="mistralai/Voxtral-Mini-3B-2507", path=None),
    dict(name="qwen_omni", family="qwen_omni", repo_id="Qwen/Qwen2.5-Omni-3B", path="/nonexistent/qwen"),
])
def test_missing_weights_fail_fast_with_a_clear_message(cfg, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    t0 = time.perf_counter()
    with pytest.raises(WeightsNotFoundError) as e:
        load_backbone(cfg, device=None, dtype=None)
    assert time.perf_counter() - t0 < 5
    assert cfg["repo_id"] in str(e.value) and "model.path" in str(e.value)


def test_multirun_sweep_2x2(tmp_path):
    env = dict(os.environ, WNW_NO_PROGRESS="1", WNW_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "wnw_exp.cli.run", "-m", *SHORT, "dataset.n=1", f"runs_root={tmp_path / 'runs'}",
           "method=adakv", "retention=0.2,0.6", "seed=0,1"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    metrics = sorted(p.relative_to(tmp_path / "runs").parent for p in (tmp_path / "runs").rglob("metrics.json"))
    extra = "dataset.max_seconds=5,dataset.min_seconds=3"  # overrides beyond the path's own keys
    assert [d.parent.as_posix() for d in metrics] == [f"tiny_random/synthetic-test/adakv/r{r}/{extra},seed={s}"
                                                      for r in ("0.2", "0.6") for s in (0, 1)]
    assert len({d.name for d in metrics}) == 4 and all(d.name.startswith("cfg-") for d in metrics)


def test_same_config_and_seed_give_byte_identical_predictions(tmp_path):
    cfg = config(tmp_path, "dataset.n=1")
    run(cfg, tmp_path / "a", progress=False)
    run(cfg, tmp_path / "b", progress=False)
    a = (tmp_path / "a" / "predictions.jsonl").read_bytes()
    assert a and a == (tmp_path / "b" / "predictions.jsonl").read_bytes()
    assert "ms_per_token" in (tmp_path / "a" / "timings.jsonl").read_text()


def test_two_runs_on_one_run_directory_are_refused(tmp_path):
    from wnw_exp.rundir import RunDirLock

    (tmp_path / "run").mkdir()
    with RunDirLock(tmp_path / "run"):
        with pytest.raises(RuntimeError, match=f"pid {os.getpid()}.* is writing to"):
            run(config(tmp_path, "dataset.n=1"), tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "predictions.jsonl").exists()


def test_audio_longer_than_the_context_fails_before_compute(tmp_path, monkeypatch):
    from wnw_exp.data.synthetic import SyntheticDataset

    original = SyntheticDataset.__getitem__

    def long_one(self, i):
        sample = original(self, i)
        if i == 0:
            sample.duration = 3600.0  # an hour: more positions than tiny_random has

            def never():
                raise AssertionError("audio must not be loaded")
            sample.load_audio = never
        return sample

    monkeypatch.setattr(SyntheticDataset, "__getitem__", long_one)
    metrics = run(config(tmp_path, "dataset.n=2"), tmp_path / "run", progress=False)
    records = read_predictions(tmp_path / "run")
    assert "the limit is about" in records[0]["error"] and "16384" in records[0]["error"]
    assert records[1]["error"] is None and metrics["n_failed"] == 1


def test_killed_run_resumes_to_the_same_result(tmp_path):
    """A real wnw-run killed with SIGKILL mid-sample, re-run with the same command."""
    import signal

    env = dict(os.environ, WNW_NO_PROGRESS="1", WNW_CACHE=str(tmp_path / "cache"))
    args = [sys.executable, "-m", "wnw_exp.cli.run", *SHORT, "dataset.n=4"]
    root = tmp_path / "killed"
    proc = subprocess.Popen(args + [f"runs_root={root}"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    preds = None
    while time.time() < deadline:  # kill once at least one sample is done and the next has started
        found = list(root.rglob("predictions.jsonl"))
        if found and found[0].read_text().count("\n") >= 1:
            preds = found[0]
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert preds is not None and preds.read_text().count("\n") < 4
    again = subprocess.run(args + [f"runs_root={root}"], env=env, capture_output=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    ids = [json.loads(x)["id"] for x in preds.read_text().splitlines()]
    assert sorted(ids) == [f"synthetic-test-{i}" for i in range(4)]
    ref_dir = tmp_path / "ref"  # the same config, uninterrupted, in-process
    cfg = config(tmp_path, "dataset.n=4")
    cfg["dataset"]["cache_dir"] = None  # as in the subprocess: $WNW_CACHE
    os.environ["WNW_CACHE"], saved = str(tmp_path / "cache"), os.environ.get("WNW_CACHE")
    try:
        run(cfg, ref_dir, progress=False)
    finally:
        os.environ.pop("WNW_CACHE") if saved is None else os.environ.__setitem__("WNW_CACHE", saved)
    assert preds.read_bytes() == (ref_dir / "predictions.jsonl").read_bytes()
    timing = {"ms_per_token"}
    m1 = json.loads((ref_dir / "metrics.json").read_text())
    m2 = json.loads((preds.parent / "metrics.json").read_text())
    assert {k: v for k, v in m1.items() if k not in timing} == {k: v for k, v in m2.items() if k not in timing}


def test_engine_key_picks_the_decode_path_and_refuses_an_unknown_one(tmp_path):
    """`engine=reference` on the CPU is the CPU default (same predictions); an unknown path is one clear error."""
    from wnw_exp.engine.runner import check_config

    cfg = config(tmp_path, "dataset.n=1", "method=wnw")
    run(cfg, tmp_path / "auto", progress=False)
    run(dict(cfg, engine="reference"), tmp_path / "reference", progress=False)
    a, b = read_predictions(tmp_path / "auto"), read_predictions(tmp_path / "reference")
    assert [r["hypothesis"] for r in a] == [r["hypothesis"] for r in b] and len(a) > 0
    with pytest.raises(ValueError, match="engine='fast'"):
        check_config(dict(cfg, engine="fast"))
