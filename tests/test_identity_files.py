"""A run's identity covers the files it reads (docs/reliability.md): the content digest of the head-score file, the
weights folder, the manifest and a data root's non-audio files is in identity.json and its `cfg-<hash>`, so a file
edited in place gives a new run directory; an untouched file is not read again (its digest is cached by path, size
and mtime) and a rerun resumes its directory."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from wnw_exp import paths, rundir
from wnw_exp.rundir import identity, identity_hash, path_digest, read_predictions

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "src/wnw_exp/calibration/shipped/tiny_random.json"
SHORT = ["model=tiny_random", "model.max_new_tokens_per_second=1", "model.min_new_tokens=4", "dataset.min_seconds=3",
         "dataset.max_seconds=4", "dataset.n=1"]


def config(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "src" / "wnw_exp" / "conf"), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=list(overrides)), resolve=True)


def wnw_run(*args, cache):
    env = dict(os.environ, WNW_NO_PROGRESS="1", WNW_CACHE=str(cache), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "wnw_exp.cli.run", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def edit_in_place(path: Path) -> None:
    """Another ranking in the same file: the sensitivities reversed (a valid head-score file, same path)."""
    scores = json.loads(path.read_text())
    scores["head_sensitivity"] = [[1 - x for x in row] for row in scores["head_sensitivity"]]
    path.write_text(json.dumps(scores))


def test_a_head_score_file_edited_in_place_gets_a_new_run_directory_and_an_untouched_one_resumes(tmp_path):
    scores = tmp_path / "head_scores.json"
    scores.write_bytes(SHIPPED.read_bytes())
    args = [*SHORT, "method=wnw", f"method.head_scores={scores}", f"runs_root={tmp_path / 'runs'}"]
    cache = tmp_path / "cache"
    first = wnw_run(*args, cache=cache)
    assert first.returncode == 0, first.stderr[-2000:]
    again = wnw_run(*args, cache=cache)  # untouched: the same directory, resumed
    assert again.returncode == 0 and "1 of 1 samples already done" in again.stderr, again.stderr[-2000:]
    (before,) = [p.parent for p in (tmp_path / "runs").rglob("identity.json")]
    edit_in_place(scores)
    edited = wnw_run(*args, cache=cache)
    assert edited.returncode == 0, edited.stderr[-2000:]
    assert "already done" not in edited.stderr
    dirs = sorted(p.parent for p in (tmp_path / "runs").rglob("identity.json"))
    assert len(dirs) == 2 and before in dirs
    digests = {json.loads((d / "identity.json").read_text())["config"]["files"]["method.head_scores"] for d in dirs}
    assert digests == {hashlib.sha256(SHIPPED.read_bytes()).hexdigest()[:16],
                       hashlib.sha256(scores.read_bytes()).hexdigest()[:16]}  # each directory: its file's bytes
    assert all(len(read_predictions(d)) == 1 for d in dirs)


def test_an_untouched_file_is_not_read_again(tmp_path, monkeypatch):
    monkeypatch.setenv("WNW_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "scores.json"
    f.write_text("version 1")
    first = path_digest(f)
    assert first == hashlib.sha256(b"version 1").hexdigest()[:16]
    paths._DIGESTS.clear()  # a new process: only the cache on disk is left

    def no_reading(*a, **k):
        raise AssertionError("an unchanged file was read again")

    monkeypatch.setattr(rundir, "open", no_reading, raising=False)
    assert path_digest(f) == first  # from $WNW_CACHE/file-digests, keyed by path, size and mtime
    monkeypatch.undo()
    monkeypatch.setenv("WNW_CACHE", str(tmp_path / "cache"))
    st = f.stat()
    f.write_text("version 2")  # the same size: the new mtime alone tells it apart
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert path_digest(f) == hashlib.sha256(b"version 2").hexdigest()[:16]


def test_weights_folders_manifests_and_data_roots_are_digested(tmp_path, monkeypatch):
    monkeypatch.setenv("WNW_CACHE", str(tmp_path / "cache"))
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    (weights / "model.safetensors").write_bytes(b"weights 1")
    cfg = config("model=voxtral", f"model.path={weights}", "dataset=manifest", f"dataset.path={tmp_path / 'set.jsonl'}")
    assert identity(cfg)["files"]["dataset.path"] == "missing"  # loading fails later with its own message
    (tmp_path / "set.jsonl").write_text('{"audio": "a.wav", "reference": "one"}\n')
    before = identity_hash(cfg)
    assert identity(cfg)["files"]["model.path"] == path_digest(weights) != "missing"
    (weights / "model.safetensors").write_bytes(b"weights 2")
    after_weights = identity_hash(cfg)
    (tmp_path / "set.jsonl").write_text('{"audio": "a.wav", "reference": "two"}\n')
    assert len({before, after_weights, identity_hash(cfg)}) == 3
    root = tmp_path / "root"
    (root / "spk").mkdir(parents=True)
    (root / "spk" / "a.flac").write_bytes(b"audio 1")
    (root / "spk" / "a.trans.txt").write_text("A ONE")
    lib = config("dataset=librispeech_long", f"dataset.root={root}")
    digest = identity(lib)["files"]["dataset.root"]
    (root / "spk" / "a.flac").write_bytes(b"audio 2, longer")  # audio is not digested
    assert identity(lib)["files"]["dataset.root"] == digest
    (root / "spk" / "a.trans.txt").write_text("A TWO")  # a transcript is
    assert identity(lib)["files"]["dataset.root"] != digest


@pytest.mark.parametrize("model", ["tiny_random", "whisper_smollm2"])
def test_the_shipped_head_scores_are_digested_when_none_is_named(model):
    files = identity(config(f"model={model}", "method=wnw"))["files"]
    shipped = ROOT / f"src/wnw_exp/calibration/shipped/{model}.json"
    assert files["method.head_scores"] == hashlib.sha256(shipped.read_bytes()).hexdigest()[:16]
    assert "method.head_scores" not in identity(config(f"model={model}", "method=adakv")).get("files", {})
