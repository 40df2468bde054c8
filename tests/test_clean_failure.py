"""Clean failure and interruption (issue 14, point 4), each on a real `wnw-run` process: an unwritable or full
disk is one line and exit 2; SIGINT and SIGTERM stop the run with metrics.json written for the finished samples
and a rerun resumes byte-identically; every failed sample is named on the console and in run.log."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from wnw_exp.engine.runner import run
from wnw_exp.paths import conf_dir

CONF = str(conf_dir())
SHORT = ["model=tiny_random", "method=full", "dataset.min_seconds=3", "dataset.max_seconds=4"]


def command(*args):
    return [sys.executable, "-m", "wnw_exp.cli.run", *args]


ENV = dict(os.environ, WNW_NO_PROGRESS="1", OMP_NUM_THREADS="1")


def wnw_run(*args):
    return subprocess.run(command(*args), capture_output=True, text=True, env=ENV, timeout=300)


def lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


@pytest.fixture
def unwritable(tmp_path):
    """A folder this process cannot write: read-only permissions, or (for root, whom they do not stop) the
    immutable attribute."""
    d = tmp_path / "ro"
    (d / "old" / "run").mkdir(parents=True)
    (d / "old" / "run" / "predictions.jsonl").write_text('{"id": "done-0"}\n')
    d.chmod(0o555)
    try:
        (d / "probe").touch()
    except PermissionError:
        yield d
        d.chmod(0o755)
        return
    (d / "probe").unlink()
    if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
        d.chmod(0o755)
        pytest.skip("running as root and chattr +i is not available: no way to make a folder unwritable")
    try:
        yield d
    finally:
        subprocess.run(["chattr", "-i", str(d)])
        d.chmod(0o755)


def test_an_unwritable_runs_root_is_one_line(unwritable):
    out = wnw_run(*SHORT, f"runs_root={unwritable}")
    assert out.returncode == 2
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"wnw-run: error: cannot write {unwritable}/.wnw-write-probe-")
    assert line.endswith("): set runs_root to a folder you can write")
    assert (unwritable / "old" / "run" / "predictions.jsonl").read_text() == '{"id": "done-0"}\n'


def test_a_disk_that_fills_during_a_run_is_one_line_and_keeps_finished_samples(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "trace").mkdir(parents=True)
    (run_dir / "trace" / "synthetic-test-1.json").symlink_to("/dev/full")  # the kernel answers ENOSPC
    out = wnw_run(*SHORT, "dataset.n=3", f"dataset.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}")
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"wnw-run: error: no space left on the disk of {run_dir} (No space left on device): free some, or set "
        "runs_root to another disk; finished samples are kept, rerun the same command to resume"]
    assert [json.loads(x)["id"] for x in (run_dir / "predictions.jsonl").read_text().splitlines()] == \
        ["synthetic-test-0"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for a tmpfs")
def test_a_disk_full_before_the_run_is_one_line(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    script = (f"mount -t tmpfs -o size=64k none {full} && (dd if=/dev/zero of={full}/fill bs=4k 2>/dev/null; "
              f"exec {' '.join(command('model=tiny_random', f'runs_root={full}/runs'))})")
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=ENV, timeout=120)
    if "mount" in out.stderr and out.returncode != 2:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"wnw-run: error: no space left on the disk of {full}/runs (No space left on device): free some, or set "
        "runs_root to another disk; finished samples are kept, rerun the same command to resume"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same 4 samples in one run, in-process."""
    root = tmp_path_factory.mktemp("reference")
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=[*SHORT, "dataset.n=4", f"dataset.cache_dir={root / 'cache'}"])
    run(OmegaConf.to_container(cfg, resolve=True), root / "run", progress=False)
    return root


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_keeps_finished_work_and_a_rerun_resumes_byte_identically(signum, uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    args = command(*SHORT, "dataset.n=4", f"dataset.cache_dir={uninterrupted / 'cache'}", f"hydra.run.dir={run_dir}")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 120
    while lines(run_dir / "predictions.jsonl") < 1 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signum)  # while the second sample is being decoded
    out, err = proc.communicate(timeout=120)
    kept = lines(run_dir / "predictions.jsonl")
    assert proc.returncode == 128 + signum and 1 <= kept < 4
    message = f"interrupted: {kept} of 4 samples kept; rerun the same command to resume"
    assert err.splitlines() == [message] and out == ""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["n_samples"] == kept and metrics["sample_ids"] == [f"synthetic-test-{i}" for i in range(kept)]
    assert message in (run_dir / "run.log").read_text()

    again = subprocess.run(args, capture_output=True, text=True, env=ENV, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stderr.splitlines() == [f"{kept} of 4 samples already done"]
    reference = uninterrupted / "run"
    assert (run_dir / "predictions.jsonl").read_bytes() == (reference / "predictions.jsonl").read_bytes()
    untimed = [{k: v for k, v in json.loads((d / "metrics.json").read_text()).items() if k != "ms_per_token"}
               for d in (run_dir, reference)]
    assert untimed[0] == untimed[1]


def test_each_failed_sample_is_named_on_the_console_and_in_run_log(tmp_path):
    sf.write(tmp_path / "good.wav", (np.random.RandomState(0).randn(16000) * 0.1).astype(np.float32), 16000)
    (tmp_path / "corrupt.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk")
    (tmp_path / "m.jsonl").write_text("".join(json.dumps({"audio": f"{n}.wav", "reference": "a b"}) + "\n"
                                              for n in ("corrupt", "good")))
    run_dir = tmp_path / "run"
    out = wnw_run("model=tiny_random", "method=full", "dataset=manifest", f"dataset.path={tmp_path / 'm.jsonl'}",
                  f"hydra.run.dir={run_dir}")
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"sample corrupt failed: AudioLoadError: cannot open audio {tmp_path / 'corrupt.wav'}")
    assert line in (run_dir / "run.log").read_text()
    assert out.stdout.splitlines()[1].split()[4:6] == ["2", "1"]  # n and fail on the console
