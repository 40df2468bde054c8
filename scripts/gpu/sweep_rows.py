"""The rows of a methods sweep's results file from its run directories: per run, the
corpus WER, each clip's WER, the median clip's WER minus Full's on the same clip, the clips at most 1 point above
Full's, the terminated answers and r_GPU (the runs' own metrics.json for the last two).

    python3 scripts/gpu/sweep_rows.py FULL_RUN_DIR RUN_DIR... > rows.json
"""
import json
import sys
from pathlib import Path

import numpy as np

from wnw_exp.metrics.text import corpus_wer, sample_wer


def clips(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "predictions.jsonl").read_text().splitlines() if x.strip()]
    return {r["id"]: r for r in rows}


def main() -> None:
    full = clips(Path(sys.argv[1]))
    full_wer = {k: sample_wer(r["reference"], r["hypothesis"]) for k, r in full.items()}
    out = []
    for d in map(Path, sys.argv[2:]):
        runs = clips(d)
        m = json.loads((d / "metrics.json").read_text())
        ids = [k for k in runs if k in full]
        per = [sample_wer(runs[k]["reference"], runs[k]["hypothesis"]) for k in ids]
        delta = [p - full_wer[k] for p, k in zip(per, ids)]
        out.append(dict(run=d.parent.name, method=d.parts[-4], retention=float(d.parts[-3][1:]),
                        n_clips=len(ids), wer=round(corpus_wer([(runs[k]["reference"], runs[k]["hypothesis"])
                                                                for k in ids]), 2),
                        full_wer_same_clips=round(corpus_wer([(full[k]["reference"], full[k]["hypothesis"])
                                                              for k in ids]), 2),
                        median_clip_minus_full=round(float(np.median(delta)), 2),
                        clips_within_1_point_of_full=int(sum(x <= 1.0 for x in delta)),
                        terminated=f"{round(m['terminated_rate'] * m['n_samples'])}/{m['n_samples']}",
                        r_gpu=round(m["r_gpu"], 3), r_gpu_cpu=round(m["r_gpu_cpu"], 3),
                        per_clip=[round(x, 2) for x in per]))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
