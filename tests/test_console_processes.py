"""The two longest console checks, on real processes, in a module of their own so that `make test`'s two workers
(`--dist loadscope`: a module's tests stay on one worker) share test_console's work: `progress=false` silences every
bar, the default model's first load included; `make figures` runs its sweep whatever else exists."""

import os
import subprocess
import sys
from pathlib import Path

from test_console import TINY, wnw_run


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


def test_make_figures_runs_its_sweep_whatever_else_exists(tmp_path):
    """Another run already under RUNS (what `make run` leaves) does not stop the sweep: the runs the figures need
    are made, with a line per sweep and per run and the total; a second time they are only resumed."""
    runs, out = tmp_path / "runs", tmp_path / "report"
    wnw_run(*TINY, "method=wnw", f"runs_root={runs}", cache=tmp_path / "c")  # something else that exists
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
