"""`pip install .` (not editable) into a fresh virtual environment, then the console scripts from another folder:
the configs, the shipped head scores and the run directory come from the installed package, not from the checkout.

The fresh environment reuses the test environment's packages (torch, transformers, hydra, pip, setuptools) through a
path file instead of downloading them, and builds wnw-exp without isolation from a copy of the checkout (the build
would leave build/ and an egg-info in the checkout): seconds, not minutes.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from wnw_exp.rundir import read_predictions

REPO = Path(__file__).resolve().parents[1]
FAST = ["model=tiny_random", "model.max_new_tokens_per_second=1", "model.min_new_tokens=4", "dataset=synthetic",
        "dataset.n=1", "dataset.min_seconds=3", "dataset.max_seconds=4"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """A fresh venv with wnw-exp pip-installed from a copy of this checkout; its python, bin and site-packages."""
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # the test environment's packages, after the venv's own (a plain path line: its .pth files, among them the
    # editable install's path to this checkout's src/, are not read)
    (site / "test-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    out = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(source)],
                         capture_output=True, text=True, env=clean_env(tmp / "cache"))
    assert out.returncode == 0, out.stderr
    return dict(python=python, bin=venv / "bin", site=site, cache=tmp / "cache", elsewhere=tmp / "elsewhere")


def clean_env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WNW_CONF", "VIRTUAL_ENV")}
    return dict(env, WNW_CACHE=str(cache), WNW_NO_PROGRESS="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


def run_in(installed: dict, *cmd: str) -> subprocess.CompletedProcess:
    installed["elsewhere"].mkdir(exist_ok=True)
    return subprocess.run([str(installed["bin"] / cmd[0]), *cmd[1:]], cwd=installed["elsewhere"], capture_output=True,
                          text=True, env=clean_env(installed["cache"]), timeout=300)


def test_the_package_and_its_configs_come_from_the_install(installed):
    out = subprocess.run([installed["python"], "-c", "import wnw_exp.paths, wnw_exp.report.build as b; "
                          "print(wnw_exp.paths.__file__); print(wnw_exp.paths.conf_dir()); print(b.DEFAULT_CONF)"],
                         cwd=installed["elsewhere"].parent, capture_output=True, text=True,
                         env=clean_env(installed["cache"]), check=True)
    module, conf, report_conf = (Path(line) for line in out.stdout.split())
    site = installed["site"]
    assert module == site / "wnw_exp" / "paths.py"
    assert conf == report_conf == site / "wnw_exp" / "conf"
    assert (conf / "config.yaml").is_file() and (conf / "calibrate.yaml").is_file()
    assert sorted(p.stem for p in (conf / "method").glob("*.yaml")) == sorted(
        p.stem for p in (REPO / "src/wnw_exp/conf/method").glob("*.yaml"))
    assert (site / "wnw_exp/calibration/shipped/tiny_random.json").is_file()


def test_wnw_run_and_wnw_report_from_another_folder(installed):
    # method=wnw (the default) reads the head scores that ship inside the package
    out = run_in(installed, "wnw-run", *FAST, "runs_root=runs")
    assert out.returncode == 0, out.stderr
    runs = installed["elsewhere"] / "runs"
    run_dirs = [p.parent for p in runs.rglob("metrics.json")]
    assert len(run_dirs) == 1
    run_dir = run_dirs[0]
    assert run_dir.relative_to(runs).parts[:4] == ("tiny_random", "synthetic-test", "wnw", "r0.2")
    assert f"run directory: {run_dir}" in out.stdout
    predictions = read_predictions(run_dir)
    assert len(predictions) == 1 and predictions[0]["reference"].strip()
    assert isinstance(predictions[0]["hypothesis"], str)

    report = run_in(installed, "wnw-report", "--runs", "runs", "--out", "report", "--no-figures")
    assert report.returncode == 0, report.stderr
    with open(installed["elsewhere"] / "report" / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["model"], r["method"], r["retention"], r["n_samples"]) for r in rows] == [
        ("tiny_random", "wnw", "0.2", "1")]
    assert (installed["elsewhere"] / "report" / "report.md").is_file()


def test_wnw_calibrate_composes_its_config_from_another_folder(installed):
    out = run_in(installed, "wnw-calibrate", "--cfg", "job", "model=tiny_random", "dataset.n=2")
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)  # calibrate.yaml's defaults and groups, with the overrides
    assert cfg["model"]["name"] == "tiny_random" and cfg["alignment"]["name"] == "oracle"
    assert (cfg["dataset"]["name"], cfg["dataset"]["split"], cfg["dataset"]["n"]) == ("synthetic", "calib", 2)
