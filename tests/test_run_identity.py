"""Results never mix (issue 14, points 1-2): every result-affecting key is in the run directory's identity
hash, a sweep over one gives a directory per value, resuming under another identity is refused, and
metrics.json, wnw-report and the console count the same samples (the ones the configuration selects)."""

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

from wnw_exp.rundir import identity, identity_hash, read_predictions
from wnw_exp.engine.runner import run
from wnw_exp.report.collect import collect_runs
from wnw_exp.paths import conf_dir

CONF = str(conf_dir())
SHIPPED = Path(__file__).resolve().parents[1] / "src/wnw_exp/calibration/shipped/tiny_random.json"
TINY = ["model=tiny_random", "model.max_new_tokens_per_second=1", "model.min_new_tokens=4"]
SHORT = [*TINY, "dataset.min_seconds=3", "dataset.max_seconds=4"]


def config(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=list(overrides)), resolve=True)


def wnw_run(*args, cache):
    env = dict(os.environ, WNW_NO_PROGRESS="1", WNW_CACHE=str(cache), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "wnw_exp.cli.run", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def write_manifest(path: Path, n: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.RandomState(n)
    for k in range(n):
        sf.write(path.parent / f"{path.parent.name}{k}.wav", (rng.randn(16000) * 0.1).astype(np.float32), 16000)
    path.write_text("".join(json.dumps({"audio": f"{path.parent.name}{k}.wav", "reference": "one two"}) + "\n"
                            for k in range(n)))
    return path


@pytest.mark.parametrize("override", ["model.path=/weights/a", "method.head_scores=/scores/b.json", "dtype=bfloat16",
                                      "seed=1", "retention=0.4", "method.n_voice=3", "dataset.split=dev",
                                      "dataset.seed=2", "model.max_new_tokens_per_second=2", "analysis=mismatch"])
def test_every_result_key_changes_the_identity(override):
    assert identity_hash(config("model=voxtral", override)) != identity_hash(config("model=voxtral"))


@pytest.mark.parametrize("override", ["device=cpu", "engine=reference", "cpu_threads=2", "progress=false", "runs_root=/elsewhere",
                                      "dataset.n=3", "dataset.shard=1", "dataset.num_shards=2",
                                      "dataset.cache_dir=/tmp/clips"])
def test_where_how_fast_and_which_samples_leave_the_identity_alone(override):
    assert identity_hash(config("model=voxtral", override)) == identity_hash(config("model=voxtral"))


def test_data_paths_are_in_the_identity_and_a_manifest_split_is_its_stem(tmp_path):
    a = config("dataset=manifest", "dataset.path=/data/a/set.jsonl")
    b = config("dataset=manifest", "dataset.path=/data/b/set.jsonl")
    assert a["dataset"]["split"] == b["dataset"]["split"] == "set"
    assert identity_hash(a) != identity_hash(b)
    roots = [config("dataset=librispeech_long", f"dataset.root=/data/{r}") for r in ("x", "y")]
    assert identity_hash(roots[0]) != identity_hash(roots[1])
    assert identity(a)["dataset"]["path"] == "/data/a/set.jsonl" and "n" not in identity(a)["dataset"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One real `wnw-run -m` over two manifests of one stem in two folders x two head-score files."""
    root = tmp_path_factory.mktemp("sweep")
    a, b = write_manifest(root / "a" / "set.jsonl", 1), write_manifest(root / "b" / "set.jsonl", 2)
    scores = json.loads(SHIPPED.read_text())
    scores["head_sensitivity"] = (1 - np.asarray(scores["head_sensitivity"])).tolist()  # another ranking
    (root / "other.json").write_text(json.dumps(scores))
    out = wnw_run("-m", *TINY, "method=wnw", "dataset=manifest", f"dataset.path={a},{b}",
                  f"method.head_scores={SHIPPED},{root / 'other.json'}", f"runs_root={root / 'runs'}",
                  cache=root / "cache")
    assert out.returncode == 0, out.stderr[-3000:]
    dirs = [p.parent for p in (root / "runs").rglob("identity.json")]
    return root, {d: json.loads((d / "identity.json").read_text()) for d in dirs}


def test_two_manifests_of_one_stem_never_share_a_run_directory(sweep):
    root, dirs = sweep
    assert len(dirs) == 4
    for d, ident in dirs.items():
        assert d.relative_to(root / "runs").parts[:3] == ("tiny_random", "manifest-set", "wnw")
        assert d.name == f"cfg-{ident['id']}"
        folder = Path(ident["config"]["dataset"]["path"]).parent.name
        ids = [r["id"] for r in read_predictions(d)]
        assert ids == [f"{folder}{k}" for k in range({"a": 1, "b": 2}[folder])]  # only its own manifest's rows


def test_a_sweep_over_head_scores_gives_one_directory_per_file(sweep):
    root, dirs = sweep
    used = sorted((ident["config"]["dataset"]["path"], ident["config"]["method"]["head_scores"])
                  for ident in dirs.values())
    assert used == sorted((str(root / m / "set.jsonl"), str(s)) for m in "ab" for s in (SHIPPED, root / "other.json"))
    for d in dirs:
        assert json.loads((d / "metrics.json").read_text())["n_samples"] == len(read_predictions(d))


def test_resuming_under_another_configuration_is_refused(tmp_path):
    cfg = config(*SHORT, "method=full", "dataset.n=1", f"dataset.cache_dir={tmp_path / 'cache'}")
    run(cfg, tmp_path / "run", progress=False)
    before = (tmp_path / "run" / "predictions.jsonl").read_bytes()
    with pytest.raises(ValueError, match=r"holds samples computed with another configuration \(config.seed: 0 there, "
                                         r"1 now\): resume it with those settings"):
        run({**cfg, "seed": 1}, tmp_path / "run", progress=False)
    assert (tmp_path / "run" / "predictions.jsonl").read_bytes() == before
    stored = json.loads((tmp_path / "run" / "identity.json").read_text())
    assert stored["id"] == identity_hash(cfg) and stored["compute_dtype"] == "float32"


def test_metrics_report_and_console_count_the_samples_the_configuration_selects(tmp_path):
    """n=3 then n=2 in one directory (dataset.n selects samples, it is not in the identity)."""
    args = [*SHORT, "method=full", f"runs_root={tmp_path / 'runs'}"]
    assert wnw_run(*args, "dataset.n=3", cache=tmp_path / "cache").returncode == 0
    out = wnw_run(*args, "dataset.n=2", cache=tmp_path / "cache")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 of 2 samples already done" in out.stderr
    (run_dir,) = [p.parent for p in (tmp_path / "runs").rglob("metrics.json")]
    assert len(read_predictions(run_dir)) == 3  # the third sample's prediction stays valid for a later n=3
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["n_samples"] == 2 and metrics["sample_ids"] == ["synthetic-test-0", "synthetic-test-1"]
    (report,) = collect_runs([tmp_path / "runs"])
    assert report.metrics == metrics
    row = out.stdout.splitlines()[1].split()
    assert row[4] == "2" and float(row[6]) == pytest.approx(metrics["wer"], abs=0.01)  # n and WER% on the console


def test_trained_weights_are_in_the_identity(tmp_path):
    """The embedded models' trained weights change while their config does not: their bytes are in the identity
    (a run directory never mixes two weight versions); a copy of the same bytes elsewhere gives the same one."""
    a, b, c = (tmp_path / n for n in "abc")
    for d, payload in ((a, b"version 1"), (b, b"version 2"), (c, b"version 1")):
        d.mkdir()
        (d / "projector.safetensors").write_bytes(payload)
    ids = {d: identity(config("model=whisper_smollm2", f"model.trained_dir={d}")) for d in (a, b, c)}
    # trained_dir itself is a result key (a path), so compare the fingerprint and the hash without it
    assert ids[a]["model_weights"] == ids[c]["model_weights"] != ids[b]["model_weights"]
    assert identity_hash(config("model=whisper_smollm2")) != identity_hash(
        config("model=whisper_smollm2", f"model.trained_dir={b}"))
    assert "model_weights" not in identity(config("model=tiny_random"))  # built from a seed: nothing to hash
    assert "model_weights" not in identity(config("model=voxtral"))  # the user's hub folder: its path is the key
    (a / "projector.safetensors").write_bytes(b"version 3")  # trained further in place: a new identity
    assert identity(config("model=whisper_smollm2", f"model.trained_dir={a}"))["model_weights"] != ids[a]["model_weights"]
