"""What `wnw-run` prints, on real processes: a `-m` sweep ends with one table (a row per job, with the job's own
metrics.json numbers and run directory), each job a `[k/N]` line; Full Cache runs once whatever the retentions
swept (and a single `method=full` run lands in the same directory); the joblib launcher's jobs run in two worker
processes and reach the table. `progress=false`, `make figures` and benchmarks/run_vs_engine.py:
test_console_processes.py."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from wnw_exp.cli.summary import run_summary, sweep_summary, swept_values, table
from wnw_exp.cli.sweep import retention_free_runs_once, sweep_axes
from wnw_exp.paths import conf_dir

CONF = conf_dir()
TINY = ["model=tiny_random", "dataset.min_seconds=3", "dataset.max_seconds=4", "model.max_new_tokens_per_second=1",
        "model.min_new_tokens=4", "dataset.n=2"]


def wnw_run(*args: str, progress_env: bool = False, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    if not progress_env:
        env["WNW_NO_PROGRESS"] = "1"
    else:
        env.pop("WNW_NO_PROGRESS", None)
    if cache is not None:
        env["WNW_CACHE"] = str(cache)
    proc = subprocess.Popen([sys.executable, "-m", "wnw_exp.cli.run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    out.pid = proc.pid  # the sweep's own process (test_parallel_jobs_...)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def sweep_table(stdout: str) -> tuple[list[str], list[dict]]:
    """The sweep's closing table: its header line's columns and one dict per row."""
    lines = stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.endswith(":") and " runs" in ln)
    header = lines[start + 1].split()
    rows = []
    for ln in lines[start + 2:]:
        if not ln.strip():
            break
        cells = ln.split()
        rows.append(dict(zip(header[:12], cells[:12]), run_dir=cells[12]))
    return header, rows


def test_a_sweep_ends_with_one_table_and_runs_full_once(tmp_path):
    root = tmp_path / "runs"
    out = wnw_run("-m", *TINY, "method=full,adakv", "retention=0.2,0.4", f"runs_root={root}", cache=tmp_path / "c")
    assert "method=full keeps every audio position: its jobs at retention 0.2, 0.4 run at retention=1.0 " \
           "(1 repeated job left out)" in out.stdout
    jobs = [ln for ln in out.stdout.splitlines() if ln.startswith("[")]
    assert [ln[:5] for ln in jobs] == ["[1/3]", "[2/3]", "[3/3]"]
    header, rows = sweep_table(out.stdout)
    assert header == ["model", "dataset", "method", "target", "n", "fail", "WER%", "BLEU", "r_gpu", "r_g+c",
                      "ms/tok", "term", "run", "directory"]
    assert [(r["method"], r["target"]) for r in rows] == [("full", "1.0"), ("adakv", "0.2"), ("adakv", "0.4")]
    for r in rows:  # each row is its run directory's metrics.json
        m = json.loads((root / r["run_dir"] / "metrics.json").read_text())
        assert r["n"] == str(m["n_samples"]) == "2" and r["fail"] == str(m["n_failed"])
        assert r["WER%"] == f"{m['wer']:.2f}" and r["r_gpu"] == f"{m['r_gpu']:.3f}" and r["BLEU"] == "-"
    # Full Cache decoded once: one run directory, at r1.0
    full_dirs = [p.parent for p in root.rglob("full/*/**/predictions.jsonl")]
    assert len(full_dirs) == 1 and "/full/r1.0/" in full_dirs[0].as_posix()
    assert len(full_dirs[0].joinpath("predictions.jsonl").read_text().splitlines()) == 2

    # a single run of method=full at another retention is the same run (resumed: nothing decoded again)
    single = wnw_run(*TINY, "method=full", "retention=0.6", f"runs_root={root}", cache=tmp_path / "c")
    assert "run at retention=1.0 (not 0.6)" in single.stderr and "2 of 2 samples already done" in single.stderr
    assert f"run directory: {full_dirs[0]}" in single.stdout
    assert len([p for p in root.rglob("full/*/**/predictions.jsonl")]) == 1


@pytest.mark.skipif(not any((Path(p) / "hydra_plugins" / "hydra_joblib_launcher").is_dir() for p in sys.path),
                    reason="hydra-joblib-launcher is not installed (pip install -e '.[launchers]')")
def test_parallel_jobs_run_in_two_worker_processes_and_reach_the_table(tmp_path):
    """`-m hydra/launcher=joblib hydra.launcher.n_jobs=2`: the two runs are done by two worker processes of one
    pool, neither of them the sweep's own process (n_jobs=1 would run them in the sweep's process); their rows
    still reach the table. (One sweep for what test_report.py and this module checked in a sweep each.)"""
    root = tmp_path / "runs"
    out = wnw_run("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *TINY, "dataset.n=1",
                  "method=full,adakv", "retention=0.3", f"runs_root={root}", cache=tmp_path / "c")
    dirs = [p.parent for p in root.rglob("metrics.json")]
    assert len(dirs) == 2
    pids = {int((d / ".lock").read_text()) for d in dirs}  # the run lock holds the writer's pid
    assert len(pids) == 2 and out.pid not in pids
    _, rows = sweep_table(out.stdout)
    assert sorted((r["method"], r["target"]) for r in rows) == [("adakv", "0.3"), ("full", "1.0")]
    # each job's line, from its worker process (two processes share the pipe: a line may land inside another's)
    assert sorted(re.findall(r"\[\d/2\] tiny_random", out.stdout)) == ["[1/2] tiny_random", "[2/2] tiny_random"], out.stdout


def test_retention_free_runs_once_on_composed_configs():
    jobs = [["method=full", "retention=0.2", "seed=0"], ["method=full", "retention=0.4", "seed=0"],
            ["method=adakv", "retention=0.2", "seed=0"], ["method=full", "retention=0.2", "seed=1"],
            ["seed=0"]]  # the default method (wnw)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        def composed(job):
            cfg = compose("config", overrides=job)
            return cfg.method.name, cfg.retention

        kept, notes = retention_free_runs_once(jobs, composed)
        assert kept == [["method=full", "seed=0", "retention=1.0"], ["method=adakv", "retention=0.2", "seed=0"],
                        ["method=full", "seed=1", "retention=1.0"], ["seed=0"]]
        assert notes == ["method=full keeps every audio position: its jobs at retention 0.2, 0.4 run at "
                         "retention=1.0 (1 repeated job left out)"]
        # Table 5's experiment: 5 methods x 4 retentions x 2 test sets, Full once per test set
        from test_report import _sweep_jobs

        main = _sweep_jobs("main")
        kept, _ = retention_free_runs_once(main, composed)
        assert len(main) == 40 and len(kept) == 4 * 4 * 2 + 2
        assert sorted(" ".join(sorted(j)) for j in kept if "method=full" in j) == [
            "+experiment=main dataset.split=test-clean method=full retention=1.0",
            "+experiment=main dataset.split=test-other method=full retention=1.0"]


def test_summary_columns_line_up():
    rows = [dict(model="whisper_smollm2", dataset="synthetic-test", method="wnw", retention=0.2, n_samples=8, n_failed=0,
                 wer=76.7, bleu=None, r_gpu=0.203, r_gpu_cpu=0.378, ms_per_token=21.83, terminated_rate=1.0,
                 run_dir="/x/y"),
            dict(model="tiny_random", dataset="librispeech_long-test-clean", method="full", retention=1.0,
                 n_samples=120, n_failed=3, wer=100.0, bleu=12.5, r_gpu=1.0, r_gpu_cpu=1.0, ms_per_token=None,
                 terminated_rate=0.0, run_dir="/x/z")]
    lines = table(rows)
    # every column ends where its header ends (right-aligned numbers) or starts where it starts (names)
    for head in ("target", "WER%", "BLEU", "ms/tok", "term"):
        end = lines[0].index(head) + len(head)
        assert all(ln[end - 1] != " " and (len(ln) == end or ln[end] == " ") for ln in lines)
    assert lines[0].index("dataset") == lines[1].index("synthetic") == lines[2].index("librispeech")
    assert run_summary(rows[0]).splitlines()[-1] == "run directory: /x/y"


def test_the_keys_a_sweep_varies_are_shown():
    jobs = [["method=oracle", "retention=0.2", "method.granularity=token", "seed=0"],
            ["method=oracle", "retention=0.4", "method.granularity=chunk", "seed=0"]]
    assert sweep_axes(jobs) == ["method.granularity"]  # method and retention have their own columns
    assert swept_values(jobs[1], ["method.granularity"]) == "method.granularity=chunk"
    row = dict(model="m", dataset="d-test", method="oracle", retention=0.4, n_samples=1, n_failed=0, wer=1.0,
               run_dir="/r/m/x", swept="method.granularity=chunk")
    text = sweep_summary([row], "/r")
    assert text.splitlines()[1].split()[-3:] == ["swept", "run", "directory"]
    assert text.splitlines()[2].split()[-2:] == ["method.granularity=chunk", "m/x"]
