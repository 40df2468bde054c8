"""Clean failure (issue 14, point 4), each on a real `wnw-run` process: every failed sample is named on the
console and in run.log."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf


def command(*args):
    return [sys.executable, "-m", "wnw_exp.cli.run", *args]


ENV = dict(os.environ, WNW_NO_PROGRESS="1", OMP_NUM_THREADS="1")


def wnw_run(*args):
    return subprocess.run(command(*args), capture_output=True, text=True, env=ENV, timeout=300)


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
