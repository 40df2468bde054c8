"""wnw-report: run directories made by the real `wnw-run` (tiny_random) -> CSV rows, tables with blanks for
missing cells, merged shards, the mismatch statistics and the figures; plus the cell-matching rules on
hand-made runs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from wnw_exp.rundir import aggregate
from wnw_exp.report.build import build_report
from wnw_exp.report.collect import Run, collect_runs, to_frame
from wnw_exp.report.specs import Cell, Matcher
from wnw_exp.report.tables import table5, to_latex, to_markdown
from wnw_exp.paths import conf_dir

BIN = Path(sys.executable).parent
SMALL = ["model=tiny_random", "dataset.min_seconds=4", "dataset.max_seconds=5", "model.max_new_tokens_per_second=1",
         "model.min_new_tokens=4", "progress=false"]


def wnw_run(root: Path, *args: str, n: int = 2) -> int:
    """Run `wnw-run` in a subprocess; returns its pid."""
    exe = shutil.which("wnw-run", path=str(BIN)) or "wnw-run"
    env = dict(os.environ, WNW_NO_PROGRESS="1", HF_HUB_OFFLINE="1")
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny decode steps: one thread is faster, and much faster on a busy machine
    proc = subprocess.Popen([exe, *args, f"runs_root={root}", f"dataset.n={n}", *SMALL], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-2000:] + err[-4000:]
    return proc.pid


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    wnw_run(root, "-m", "method=full,adakv", "retention=0.2,0.4")
    wnw_run(root, "-m", "method=adakv", "retention=0.4", "dataset.num_shards=2", "dataset.shard=0,1")
    wnw_run(root, "method=full", "retention=1.0", "analysis=mismatch")
    return root


@pytest.fixture(scope="module")
def report(runs_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    return build_report([runs_root], out), out


def _row(frame: pd.DataFrame, **kw) -> pd.DataFrame:
    sel = frame
    for k, v in kw.items():
        sel = sel[sel[k].isna()] if v is None else sel[sel[k] == v]
    return sel


def test_csv_one_row_per_run(report, runs_root):
    res, out = report
    frame = pd.read_csv(out / "runs.csv")
    # full once (at retention 1.0, whatever the sweep's retentions), adakv x2, the two adakv shards merged into
    # one, the analysis run
    assert len(frame) == 5
    assert {"model", "dataset", "split", "method", "retention", "r_gpu", "r_gpu_cpu", "wer", "bleu", "ms_per_token",
            "mb_per_step", "terminated_rate", "n_samples", "n_failed", "floor_alpha"} <= set(frame.columns)
    assert set(frame["model"]) == {"tiny_random"} and set(frame["dataset"]) == {"synthetic"}
    for run_dir in runs_root.rglob("metrics.json"):
        cfg = yaml.safe_load((run_dir.parent / ".hydra" / "config.yaml").read_text())
        if cfg["dataset"]["num_shards"] > 1:
            continue
        m = json.loads(run_dir.read_text())
        row = _row(frame, method=cfg["method"]["name"], retention=cfg["retention"], analysis=cfg["analysis"],
                   num_shards=1)
        assert len(row) == 1
        assert row["wer"].iloc[0] == pytest.approx(m["wer"])
        assert row["n_samples"].iloc[0] == m["n_samples"] == 2
    adakv = _row(frame, method="adakv", retention=0.2)
    assert adakv["r_gpu"].iloc[0] == pytest.approx(0.2, abs=0.03)
    assert adakv["floor_alpha"].iloc[0] == pytest.approx(0.8)  # a method knob, as a column


def test_shards_merged_like_one_run(report):
    res, out = report
    frame = pd.read_csv(out / "runs.csv")
    merged = _row(frame, method="adakv", retention=0.4, num_shards=2)
    whole = _row(frame, method="adakv", retention=0.4, num_shards=1)
    assert len(merged) == len(whole) == 1
    assert merged["shards"].iloc[0] == "0,1" and bool(merged["complete"].iloc[0])
    assert merged["n_samples"].iloc[0] == 2
    assert merged["wer"].iloc[0] == pytest.approx(whole["wer"].iloc[0])  # greedy decoding is deterministic
    assert merged["r_gpu"].iloc[0] == pytest.approx(whole["r_gpu"].iloc[0])


def test_table5_values_and_blanks(report):
    res, out = report
    t = next(t for t in res.tables if t.key == "table5_main")
    md = (out / "tables" / "table5_main.md").read_text()
    block = md.split("Backbone: tiny_random (stand-in)")[1]
    lines = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in block.splitlines()
             if ln.startswith("| ") and "**" not in ln}
    frame = pd.read_csv(out / "runs.csv")
    wer = {r: _row(frame, method="adakv", retention=r, num_shards=1)["wer"].iloc[0] for r in (0.2, 0.4)}
    # columns: test-clean 0.8 0.6 0.4 0.2 | test-other 0.8 0.6 0.4 0.2 (test-other has no stand-in data)
    assert lines["Ada-KV"] == ["", "", f"{wer[0.4]:.2f}", f"{wer[0.2]:.2f}", "", "", "", ""]
    full = _row(frame, method="full", retention=1.0, analysis=None)["wer"].iloc[0]  # not the analysis run
    assert lines["Full Cache"][:4] == [f"{full:.2f}"] * 4
    assert lines["ArkVale"] == [""] * 8 and lines["WnW (ours)"] == [""] * 8
    # every blank is listed, nothing else is
    missing = "\n".join(t.missing)
    assert "tiny_random test-clean adakv r=0.8" in missing and "tiny_random test-clean adakv r=0.4" not in missing
    assert "tiny_random test-other adakv r=0.2 [wer]: no stand-in data set" in missing
    assert "voxtral test-clean wnw r=0.2 n_voice=90" in missing
    assert t.n_filled == 3 and len(t.missing) == t.n_cells - 3
    assert "tiny_random test-clean adakv r=0.8" in (out / "missing.md").read_text()
    tex = (out / "tables" / "table5_main.tex").read_text()
    assert r"\multicolumn{4}{c}{" + f"{full:.2f}" + "}" in tex and r"\toprule" in tex


def test_every_table_and_figure_written(report):
    res, out = report
    for key in ("table1_affpool", "table2_generalisation", "table3_ablations", "table4_runtime", "table5_main",
                "table6_scaling", "table7_sensitivity", "table8_calibration", "mismatch"):
        assert (out / "tables" / f"{key}.md").stat().st_size > 0
        assert (out / "tables" / f"{key}.tex").read_text().startswith(r"\begin{table}")
    for stem in ("figure1_mismatch_tiny_random", "figure3_wer_vs_retention", "figure4_gpu_kv_tiny_random"):
        for ext in (".png", ".pdf"):
            assert (out / "figures" / f"{stem}{ext}").stat().st_size > 1000
    assert "figures/figure3_wer_vs_retention.png" in (out / "report.md").read_text()


def test_mismatch_summary_from_traces(report, runs_root):
    res, out = report
    summary = json.loads((out / "mismatch.json").read_text())
    assert len(summary) == 1 and summary[0]["n_samples"] == 2
    traces = [json.loads(p.read_text())["mismatch"] for p in runs_root.rglob("trace/*.json")
              if "analysis=mismatch" in str(p)]
    assert len(traces) == 2
    for key, path in (("prefill.first10", ("prefill", "first10")), ("jaccard.100", ("jaccard", "100")),
                      ("decode.second_half", ("decode", "second_half"))):
        expected = sum(t["stats"][path[0]][path[1]] for t in traces) / 2
        assert summary[0]["stats"][key] == pytest.approx(expected)
    ph = summary[0]["per_head"]
    assert ph["n_heads"] == 3 * 4  # tiny_random: 3 layers x 4 KV heads
    assert 0 <= ph["min"] <= ph["max"] <= 1
    assert sum(summary[0]["prefill_grid"]) == pytest.approx(1.0)


def test_cli_writes_the_report(runs_root, tmp_path):
    from wnw_exp.cli.report import main

    assert main(["--runs", str(runs_root), "--out", str(tmp_path), "--models", "tiny_random", "--no-figures",
                 "--stand-in", "test-other=synthetic/test"]) == 0
    md = (tmp_path / "tables" / "table5_main.md").read_text()
    assert "Voxtral" not in md  # --models restricts the backbone axis
    t5 = md.split("\n")
    ada = next(ln for ln in t5 if ln.startswith("| Ada-KV"))
    assert len([c for c in ada.split("|")[2:-1] if c.strip()]) == 4  # test-other now maps to synthetic/test too


# --- the matching rules on hand-made runs --------------------------------------------------------------------
WNW_DEFAULTS = {"wnw": {"n_voice": "auto", "n_anchor": "auto", "lam": "auto", "signal": "vs_hs",
                        "selection": "segment", "chunk_seconds": 4.0, "stride_seconds": 2.0, "head_scores": None}}


def fake_run(method, retention, wer, *, cfg=None, overrides=None, policy=None, model="voxtral", split="test-clean",
             calibration=None, n_failed=0):
    config = dict(model=dict(name=model), dataset=dict(name="librispeech_long", split=split, num_shards=1),
                  method=dict(name=method, **(WNW_DEFAULTS.get(method, {}) | (cfg or {}))), retention=retention,
                  analysis=None)
    if calibration:
        config["calibration"] = calibration
    records = [dict(id="a", reference="x", hypothesis="x", error=None, knobs=policy or {})]
    metrics = dict(wer=wer, r_gpu=retention, n_samples=4, n_failed=n_failed)
    return Run([Path(f"/runs/{method}/{retention}/{overrides}")], config, dict(overrides or {}), None, records, metrics)


def test_ablation_and_sensitivity_runs_never_fill_main_cells():
    main = fake_run("wnw", 0.2, 6.2, policy=dict(n_voice=90, n_anchor=5))
    a1 = fake_run("wnw", 0.2, 50.0, cfg=dict(n_voice=10), overrides={"method.n_voice": "10"},
                  policy=dict(n_voice=10, n_anchor=5))
    sens = fake_run("wnw", 0.2, 7.0, cfg=dict(chunk_seconds=0.96, stride_seconds=0.48),
                    overrides={"sensitivity": "chunk_0.96"}, policy=dict(n_voice=90, n_anchor=5))
    cell = Cell("voxtral", "test-clean", "wnw", 0.2, (("n_voice", 90),))
    m = Matcher([main, a1, sens], WNW_DEFAULTS)
    assert m.find(cell) == (main, 1)
    assert m.find(Cell("voxtral", "test-clean", "wnw", 0.2, (("n_voice", 10),)))[0] is a1
    assert m.find(Cell("voxtral", "test-clean", "wnw", 0.2, (("chunk_seconds", 0.96),),
                       free=("stride_seconds",)))[0] is sens
    # without the main run, the cell stays empty: no other run stands in for it
    assert Matcher([a1, sens], WNW_DEFAULTS).find(cell) == (None, 0)
    # head_scores is a deployment detail; calibration is not
    other_file = fake_run("wnw", 0.2, 6.3, cfg=dict(head_scores="/x.json"), policy=dict(n_voice=90))
    assert Matcher([other_file], WNW_DEFAULTS).find(cell)[0] is other_file
    calib = fake_run("wnw", 0.2, 6.4, calibration="ls_fr", policy=dict(n_voice=90))
    assert Matcher([calib], WNW_DEFAULTS).find(cell)[0] is None
    assert Matcher([calib], WNW_DEFAULTS).find(Cell("voxtral", "test-clean", "wnw", 0.2, calibration="ls_fr"))[0] \
        is calib


def test_full_cache_prefers_retention_one():
    runs = [fake_run("full", r, 6.79) for r in (0.2, 0.8, 1.0)]
    assert Matcher(runs, {}).find(Cell("voxtral", "test-clean", "full", None))[0] is runs[2]
    assert Matcher(runs[:2], {}).find(Cell("voxtral", "test-clean", "full", None))[0] is runs[1]


def test_table5_layout_marks_and_missing():
    runs = [fake_run("full", 1.0, 6.79), fake_run("adakv", 0.8, 137.46, n_failed=1),
            fake_run("wnw", 0.2, 6.23, policy=dict(n_voice=90)), fake_run("adakv", 0.2, 199.24, split="test-other")]
    t = table5(Matcher(runs, WNW_DEFAULTS), ["voxtral"])
    md = to_markdown(t)
    assert "| Full Cache | 6.79 | 6.79 | 6.79 | 6.79 |  |  |  |  |" in md  # one value across its four columns
    assert "| Ada-KV | 137.46† |  |  |  |  |  |  | 199.24 |" in md
    assert "| WnW r_GPU (%) |  |  |  | 20.00 |" in md
    # Full, four methods, the oracle bound at both granularities, WnW's two retention rows
    assert t.n_cells == 1 * (2 + 4 * 8 + 2 * 8 + 2 * 8) and t.n_filled == 5
    assert "voxtral test-clean oracle r=0.2 granularity=chunk [wer]: no run" in t.missing
    assert "voxtral test-other full [wer]: no run" in t.missing
    tex = to_latex(t)
    assert r"\multicolumn{4}{c}{6.79}" in tex and r"137.46$^\dagger$" in tex


def _write_dir(d: Path, shard: int, num_shards: int, records: list[dict], n: int | None = None) -> None:
    (d / ".hydra").mkdir(parents=True)
    cfg = dict(model=dict(name="tiny_random"), dataset=dict(name="synthetic", split="test", shard=shard,
                                                          num_shards=num_shards, n=n),
               method=dict(name="full"), retention=1.0, analysis=None, runs_root="x")
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"dataset.shard={shard}",
                                                                 f"dataset.num_shards={num_shards}"]))
    (d / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_shard_merge_recomputes_metrics_from_the_union(tmp_path):
    def rec(i, hyp, ref):
        return dict(id=f"s{i}", reference=ref, hypothesis=hyp, task="transcribe", terminated=True, r_gpu=1.0,
                    r_gpu_cpu=1.0, ms_per_token=None, mb_per_step=0.0, error=None)

    a = [rec(0, "a b c", "a b c"), rec(2, "x", "a b")]
    b = [rec(1, "a b", "a b c d")]
    _write_dir(tmp_path / "r" / "dataset.num_shards=3,dataset.shard=0", 0, 3, a)
    _write_dir(tmp_path / "r" / "dataset.num_shards=3,dataset.shard=2", 2, 3, b)
    runs = collect_runs([tmp_path])
    assert len(runs) == 1
    run = runs[0]
    assert run.shards == [0, 2] and run.num_shards == 3 and not run.complete  # shard 1 is missing
    assert run.metrics == aggregate(a + b)  # no n_selected recorded, no dataset.n: none added
    assert run.metrics["wer"] == pytest.approx(100 * (0 + 2 + 2) / (3 + 4 + 2))
    row = to_frame(runs).iloc[0]
    assert row["shards"] == "0,2" and not row["complete"] and "dataset.shard" not in row["overrides"]


def test_an_interrupted_run_is_marked_incomplete(tmp_path):
    """A run that kept fewer samples than its configuration selects (metrics.json's n_selected, or dataset.n for
    runs written before it was recorded) is incomplete: ‡ in the tables, complete=False in runs.csv."""
    rec = dict(id="s0", reference="a b", hypothesis="a b", task="transcribe", terminated=True, r_gpu=1.0,
               r_gpu_cpu=1.0, ms_per_token=None, mb_per_step=0.0, error=None)
    _write_dir(tmp_path / "legacy", 0, 1, [rec], n=20)  # no n_selected: dataset.n says 20
    (run,) = collect_runs([tmp_path / "legacy"])
    assert run.n_selected == 20 and not run.complete
    d = tmp_path / "new"
    _write_dir(d, 0, 1, [rec], n=20)  # the data set had one sample only: metrics.json says so
    (d / "metrics.json").write_text(json.dumps(aggregate([rec]) | dict(n_selected=1)))
    (run,) = collect_runs([d])
    assert run.n_selected == 1 and run.complete
    (d / "metrics.json").write_text(json.dumps(aggregate([rec]) | dict(n_selected=4)))
    (run,) = collect_runs([d])
    assert not run.complete and not to_frame([run]).iloc[0]["complete"]
    t = table5(Matcher([Run([d], dict(model=dict(name="voxtral"), dataset=dict(name="librispeech_long",
               split="test-clean", num_shards=1), method=dict(name="full"), retention=1.0, analysis=None), {},
               None, [rec], dict(wer=0.0, n_samples=1, n_failed=0), n_selected=4)], WNW_DEFAULTS), ["voxtral"])
    assert "| Full Cache | 0.00‡ |" in to_markdown(t)
    # one configuration in two directories of one shard (a key spelled out, e.g. analysis=null, changes the
    # directory, not the identity): n_selected 2 in one, 1 in the other; the union holds both selected samples
    rec1 = dict(rec, id="s1")
    for name, recs in (("a", [rec, rec1]), ("b", [rec])):
        _write_dir(tmp_path / "two" / name, 0, 1, recs, n=len(recs))
        (tmp_path / "two" / name / "metrics.json").write_text(json.dumps(aggregate(recs) | dict(n_selected=len(recs))))
    (run,) = collect_runs([tmp_path / "two"])
    assert run.n_selected == 2 and run.complete


# (that the joblib launcher's two runs are made by two worker processes of one pool: test_console.py's
# test_parallel_jobs_run_in_two_worker_processes_and_reach_the_table, in the same sweep as its table check)


# --- the experiment configs ------------------------------------------------------------------------------------
CONF = conf_dir()
EXPERIMENTS = ["main", "affpool", "generalisation", "ablation_a1", "ablation_a2", "ablation_a3", "sensitivity",
               "scaling_24b", "calibration_robustness", "runtime", "oracle"]


def _sweep_jobs(experiment: str) -> list[list[str]]:
    """The override lists `wnw-run -m +experiment=<name>` launches (the basic sweeper's product)."""
    import itertools

    params = yaml.safe_load((CONF / "experiment" / f"{experiment}.yaml").read_text())["hydra"]["sweeper"]["params"]
    axes = []
    for key, values in params.items():
        values = str(values)
        if values.startswith("glob("):
            group = key.lstrip("+")
            values = ",".join(sorted(p.stem for p in (CONF / group).glob("*.yaml")))
        axes.append([f"{key}={v}" for v in values.split(",")])
    return [[f"+experiment={experiment}", *combo] for combo in itertools.product(*axes)]


def test_experiments_compose_and_never_share_a_run_directory():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    exclude = set(yaml.safe_load((CONF / "config.yaml").read_text())["hydra"]["job"]["config"]["override_dirname"]
                  ["exclude_keys"])
    seen: dict[str, dict] = {}
    counts = {}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for name in EXPERIMENTS:
            jobs = _sweep_jobs(name)
            counts[name] = len(jobs)
            for overrides in jobs:
                cfg = compose("config", overrides=overrides)
                job = OmegaConf.to_container(cfg, resolve=True)
                dirname = ",".join(sorted(o for o in overrides if o.split("=")[0].lstrip("+") not in exclude))
                run_dir = (f"{job['model']['name']}/{job['dataset']['name']}-{job['dataset']['split']}/"
                           f"{job['method']['name']}/r{job['retention']}/{dirname}")
                job.pop("calibration_files", None)
                if run_dir in seen:
                    assert seen[run_dir] == job, f"{name}: {run_dir} would hold two different configurations"
                seen[run_dir] = job
    assert counts == {"main": 40, "affpool": 8, "generalisation": 15, "ablation_a1": 10, "ablation_a2": 4,
                      "ablation_a3": 2, "sensitivity": 10, "scaling_24b": 10, "calibration_robustness": 4,
                      "runtime": 6, "oracle": 16}
    jobs = _sweep_jobs("sensitivity")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        chunk = compose("config", overrides=[o for o in jobs if "+sensitivity=chunk_0.96" in o][0])
        calib = compose("config", overrides=["+experiment=calibration_robustness", "calibration=ls_fr"])
    assert chunk.method.name == "wnw" and chunk.retention == 0.2
    assert (chunk.method.chunk_seconds, chunk.method.stride_seconds) == (0.96, 0.48)
    assert "longspeech_asr_fr" in calib.method.head_scores and calib.method.n_voice == 90
