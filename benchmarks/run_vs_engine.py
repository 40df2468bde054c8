"""A `wnw-run` directory's ms/token against the engine's own for the same samples (issue 15: within 10%).

`wnw-run` records each sample's ms/token (`timings.jsonl`, the engine's `DecodeResult.ms_per_token`: the median
step of that sample, the first sample's kernel compilation and graph capture included). This reads the directory's
configuration (`.hydra/config.yaml`), rebuilds its backbone, method and data set, and decodes the same samples again
through `engine.serve.generate` on the default path, warmed (`--warm` decodes first), each for its recorded answer
length; the row compares the medians over the samples (and each sample's pair).

    PYTHONPATH=src python3 benchmarks/run_vs_engine.py outputs/runs/.../cfg-xxxxxxxx [--n 4] [--out x.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--n", type=int, default=4, help="samples compared (the first finished ones)")
    ap.add_argument("--warm", type=int, default=1, help="decodes of the first sample before the timed ones")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    from omegaconf import OmegaConf

    from wnw_exp.rundir import PREDICTIONS, read_predictions

    cfg_file = a.run_dir / ".hydra" / "config.yaml"
    if not cfg_file.is_file() or not (a.run_dir / PREDICTIONS).is_file():
        raise SystemExit(f"run_vs_engine: {a.run_dir} is not a finished wnw-run directory (no .hydra/config.yaml or "
                         "predictions.jsonl): pass the cfg-* folder a run wrote")
    cfg = OmegaConf.to_container(OmegaConf.load(cfg_file), resolve=True)
    import torch

    from wnw_exp.backbones import load_backbone, resolve_device, resolve_dtype, set_cpu_threads
    from wnw_exp.data import build_dataset
    from wnw_exp.engine.serve import generate
    from wnw_exp.engine.runner import ENGINE_PATHS, _prompt
    from wnw_exp.methods import build_policy

    records = [r for r in read_predictions(a.run_dir) if r.get("error") is None and r.get("ms_per_token")][: a.n]
    if not records:
        raise SystemExit(f"run_vs_engine: {a.run_dir} has no finished sample with a ms/token")
    device = resolve_device(cfg["device"])
    dtype = resolve_dtype(cfg["dtype"], device)
    set_cpu_threads(cfg.get("cpu_threads"), device)  # as the run did
    backbone = load_backbone(cfg["model"], device, dtype)
    policy = build_policy(cfg["method"], backbone.describe())
    dataset = build_dataset(cfg["dataset"])
    index = {sid: i for i, sid in enumerate(dataset.ids)}
    path = ENGINE_PATHS[cfg.get("engine", "auto")]

    def decode(rec: dict) -> dict:
        prompt, _ = _prompt(dataset[index[rec["id"]]], backbone, cfg)
        res = generate(backbone, prompt, policy.fork(), retention=cfg["retention"],
                       max_new_tokens=rec["n_new_tokens"], **path)
        text = backbone.decode([t for t in res.tokens if t not in backbone.eos_token_ids])
        # the same answer as the run's (a check that the rebuilt configuration is the run's; on a GPU bf16 may part)
        return dict(engine_ms_per_token=res.ms_per_token, same_hypothesis=text == rec["hypothesis"])

    for _ in range(a.warm):
        decode(records[0])
    rows = [dict(id=r["id"], n_new_tokens=r["n_new_tokens"], run_ms_per_token=r["ms_per_token"], **decode(r))
            for r in records]
    run_ms = statistics.median(r["run_ms_per_token"] for r in rows)
    eng_ms = statistics.median(r["engine_ms_per_token"] for r in rows)
    out = dict(kind="run_vs_engine", run_dir=str(a.run_dir), model=cfg["model"]["name"], method=cfg["method"]["name"],
               retention=cfg["retention"], device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               run_ms_per_token=run_ms, engine_ms_per_token=eng_ms, run_over_engine=run_ms / eng_ms,
               within_10_percent=abs(run_ms / eng_ms - 1) <= 0.10, samples=rows,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               command=" ".join(["benchmarks/run_vs_engine.py", *(sys.argv[1:] if argv is None else argv)]))
    print(json.dumps(out), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
