"""Does `wnw-run batch_size=B` give the bs-1 tokens "while the logits agree" (issue 16)? Each sample is decoded
alone (`generate`) and in a batch (`decode_batch`, what `batch_size` runs), both keeping every step's logits; at the
first step where the two token sequences part, this reports the bs-1 logit margin there (top-1 minus top-2) and
how far the two runs' logits had drifted apart over the steps before it. A parting at a near-tie (a margin within
the drift) is bf16 rounding deciding a tie; a parting at a clear margin would be a bug.

    python3 benchmarks/batch_parity.py [wnw-run overrides] [--batch-size 8] [--out parity.json]
    python3 benchmarks/batch_parity.py model=tiny_random dataset.n=3 --batch-size 3      # CPU: fp32, no parting

A row per sample: {"id", "identical", "steps", "part_at", "margin_at_part", "rank_of_batched_token",
"max_drift_before"} (margins and drift in logits; part_at None where the tokens agree to the shorter end), then a
summary row with the margins at the parting steps against the typical margin of the same runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from wnw_exp.paths import conf_dir



def margin(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def compare(alone, batched) -> dict:
    """One sample's two results (tokens, per-step logits) compared."""
    a, b = alone.tokens, batched.tokens
    n = min(len(a), len(b))
    part = next((i for i in range(n) if a[i] != b[i]), None)
    upto = part if part is not None else n
    drift = [float((alone.logits[i].float() - batched.logits[i].float()).abs().max()) for i in range(upto)]
    row = dict(identical=a == b, steps=[len(a), len(b)], part_at=part, max_drift_before=max(drift, default=0.0),
               median_margin=statistics.median(margin(x) for x in alone.logits) if alone.logits else None)
    if part is not None:
        la = alone.logits[part].float()
        row.update(margin_at_part=margin(la), drift_at_part=float((la - batched.logits[part].float()).abs().max()),
                   rank_of_batched_token=int((la > la[b[part]]).sum()))
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--out", default=None)
    a, overrides = ap.parse_known_args(argv)
    from wnw_exp.backbones import load_backbone, resolve_device, resolve_dtype, set_cpu_threads
    from wnw_exp.data import build_dataset
    from wnw_exp.engine.serve import Request, decode_batch, default_pool, generate
    from wnw_exp.engine.runner import ENGINE_PATHS, _prompt
    from wnw_exp.methods import build_policy

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)
    device = resolve_device(cfg["device"])
    dtype = resolve_dtype(cfg["dtype"], device)
    set_cpu_threads(cfg.get("cpu_threads"), device)
    torch.manual_seed(cfg["seed"])
    backbone = load_backbone(cfg["model"], device, dtype)
    policy = build_policy(cfg["method"], backbone.describe())
    policy.check(cfg["retention"])
    path = ENGINE_PATHS[cfg.get("engine", "auto")]
    dataset = build_dataset(cfg["dataset"])
    samples = [dataset[i] for i in range(len(dataset))]
    prompts = {s.id: _prompt(s, backbone, cfg) for s in samples}
    alone = {sid: generate(backbone, p, policy.fork(), retention=cfg["retention"], max_new_tokens=cap,
                           keep_logits=True, **path) for sid, (p, cap) in prompts.items()}
    pool = default_pool(backbone, cfg.get("kv_pool_gb")) if path.get("store") != "reference" else None
    batched = dict(decode_batch(backbone, (Request(sid, p, cap) for sid, (p, cap) in prompts.items()), policy.fork,
                                retention=cfg["retention"], max_concurrent=a.batch_size, pool=pool, keep_logits=True,
                                **path))
    rows = []
    for sid in prompts:
        res = batched[sid]
        rows.append(dict(id=sid, **(compare(alone[sid], res) if not isinstance(res, Exception)
                                     else dict(error=f"{type(res).__name__}: {res}"))))
        print(json.dumps(rows[-1]), flush=True)
    parted = [r for r in rows if r.get("part_at") is not None]
    summary = dict(kind="batch_parity_summary", model=cfg["model"]["name"], method=cfg["method"]["name"],
                   retention=cfg["retention"], dtype=str(dtype).removeprefix("torch."), device=str(device),
                   gpu=torch.cuda.get_device_name(0) if device.type == "cuda" else None, batch_size=a.batch_size,
                   samples=len(rows), identical=sum(bool(r.get("identical")) for r in rows), parted=len(parted),
                   margins_at_part=[round(r["margin_at_part"], 4) for r in parted],
                   drift_before_part=[round(r["max_drift_before"], 4) for r in parted],
                   median_margin=statistics.median(r["median_margin"] for r in rows if r.get("median_margin") is not None)
                   if rows else None,
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   command=" ".join(["benchmarks/batch_parity.py", *argv]))
    print(json.dumps(summary), flush=True)
    rows.append(summary)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
