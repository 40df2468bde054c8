"""The longest console checks, on real processes, in a module of their own so that `make test`'s two workers
(`--dist loadscope`: a module's tests stay on one worker) share test_console's work: `progress=false` silences every
bar, the default model's first load included; `make figures` runs its sweep whatever else exists;
benchmarks/run_vs_engine.py times a run directory's samples again. The last two share one `wnw-run` of
tiny_random's WnW (`wnw_run_root`)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_console import TINY, wnw_run


@pytest.fixture(scope="module")
def wnw_run_root(tmp_path_factory):
    """(runs_root holding one finished `wnw-run` of tiny_random's WnW, its clip cache); only read by the tests."""
    root = tmp_path_factory.mktemp("wnw_run")
    wnw_run(*TINY, "method=wnw", f"runs_root={root / 'runs'}", cache=root / "c")
    return root / "runs", root / "c"


def test_progress_false_silences_every_bar(tmp_path):
    """progress=false: no bar at all, the libraries' included. The default model's first load on a machine converts
    the SmolLM2 GGUF, which transformers does under a plain tqdm bar that ignores its own switch (silenced in
    `convert.gguf_llama`); the quiet run here is that first load (a fresh cache). The loud run shows our own bar."""
    args = ["dataset.n=1", "dataset.min_seconds=3", "dataset.max_seconds=4", "model.min_new_tokens=4",
            "model.max_new_tokens_per_second=1"]
    cache = tmp_path / "c"
    quiet = wnw_run(*args, f"runs_root={tmp_path / 'quiet'}", "progress=false", progress_env=True, cache=cache)
    assert list((cache / "pretrained").glob("smollm2*/model.safetensors"))  # the conversion ran in this call
    assert "%|" not in quiet.stderr and "de-quantizing" not in quiet.stderr and "it/s" not in quiet.stderr
    assert "run directory:" in quiet.stdout
    loud = wnw_run(*args, f"runs_root={tmp_path / 'loud'}", progress_env=True, cache=cache)
    assert "%|" in loud.stderr and "sample/s" in loud.stderr
    again = wnw_run(*args, f"runs_root={tmp_path / 'quiet'}", "progress=false", progress_env=True, cache=cache)
    assert "%|" not in again.stderr and "it/s" not in again.stderr  # resuming: our messages stay, the bars do not
    assert "1 of 1 samples already done" in again.stderr and "run directory:" in again.stdout


def test_make_figures_runs_its_sweep_whatever_else_exists(tmp_path, wnw_run_root):
    """Another run already under RUNS (what `make run` leaves) does not stop the sweep: the runs the figures need
    are made, with a line per sweep and per run and the total; a second time they are only resumed."""
    runs, out = tmp_path / "runs", tmp_path / "report"
    shutil.copytree(wnw_run_root[0], runs)  # something else that exists: a copy of a finished wnw-run
    shutil.copytree(wnw_run_root[1], tmp_path / "c")  # and the clips it cached, as if it had run here
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WNW_CACHE=str(tmp_path / "c"), RUNS=str(runs),
               OUT=str(out), BIN=str(Path(sys.executable).parent), FIGURES_MODEL="tiny_random", FIGURES_N="1",
               FIGURES_METHODS="adakv", FIGURES_JOBS="1",
               FIGURES_ARGS="dataset.min_seconds=3 dataset.max_seconds=4 model.max_new_tokens_per_second=1 "
                            "model.min_new_tokens=4")
    script = Path(__file__).resolve().parents[1] / "scripts" / "make_figures.sh"
    first = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    lines = first.stdout.splitlines()
    assert lines[0].startswith("make figures: 6 runs on model=tiny_random (synthetic clips per run: 1) in 2 sweeps")
    assert any(ln.startswith("make figures: sweep 1 of 2: adakv") for ln in lines)
    assert any(ln.startswith("make figures: sweep 2 of 2: Full Cache") for ln in lines)
    assert sum(ln.startswith("[") for ln in lines) == 6  # a line per run: 4 adakv, Full plain and with the analysis
    assert any(ln.startswith("make figures: the sweep took") for ln in lines)
    assert len(list(runs.rglob("adakv/*/**/metrics.json"))) == 4 and len(list(runs.rglob("full/*/**/metrics.json"))) == 2
    assert (out / "figures" / "figure3_wer_vs_retention.png").exists()
    second = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert second.returncode == 0
    assert second.stderr.count("1 of 1 samples already done") == 6


def test_run_vs_engine_times_a_run_directorys_samples_through_the_engine(tmp_path, wnw_run_root):
    """benchmarks/run_vs_engine.py (issue 15's wnw-run-within-10% row): it rebuilds a run directory's
    configuration, decodes the same samples again through the engine, to the same answers, and puts the run's
    recorded ms/token beside the engine's; a folder that is not a run directory gets one line."""
    from wnw_exp.rundir import read_predictions

    root, cache = wnw_run_root
    (run_dir,) = root.rglob("cfg-*")
    bench = [sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks" / "run_vs_engine.py")]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WNW_CACHE=str(cache))
    out = subprocess.run([*bench, str(run_dir), "--n", "2", "--out", str(tmp_path / "row.json")], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads((tmp_path / "row.json").read_text())
    preds = {r["id"]: r for r in read_predictions(run_dir)}
    assert [x["id"] for x in row["samples"]] == list(preds)[:2]
    for x in row["samples"]:
        rec = preds[x["id"]]
        assert x["run_ms_per_token"] == rec["ms_per_token"] and x["n_new_tokens"] == rec["n_new_tokens"]
        assert x["engine_ms_per_token"] > 0 and x["same_hypothesis"]  # CPU fp32: the run's answer again
    assert (row["model"], row["method"], row["retention"]) == ("tiny_random", "wnw", 0.2)
    assert row["run_over_engine"] == row["run_ms_per_token"] / row["engine_ms_per_token"]
    bad = subprocess.run([*bench, str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "is not a finished wnw-run directory" in bad.stderr
