#!/usr/bin/env python
"""Paired bootstrap intervals for results JSONs that keep per-clip WERs but no run directories.

    python scripts/intervals_from_results.py benchmarks/results/2026-12-02-whisper_smollm2-step8595-oracle-cpu.json \
        --references RUN_DIR/predictions.jsonl

The JSON's `rows` each hold `method`, `retention`, `overrides` and `per_clip` (truncated WER in percent, two
decimals, one per clip in sample-id order: synthetic-test-0, -1, ...). The per-clip edit counts are recovered as
WER x reference words / 100 with the reference words of the same clips from any run's predictions.jsonl (the
script refuses when a count is not an integer to within rounding, i.e. when the clips do not match; rows of another
number of clips are left out, and named; rows whose settings read alike are told apart by file and row). Printed:
every row minus Full Cache, and every pair of rows at the same retention, as `metrics.bootstrap.paired_bootstrap_wer`
gives them (10,000 resamples, seed 0).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from collections import Counter
from pathlib import Path

from wnw_exp.metrics.bootstrap import paired_bootstrap_wer
from wnw_exp.metrics.text import wer_counts


def _clip_order(sample_id: str) -> tuple[str, int]:
    m = re.fullmatch(r"(.*?)(\d+)", sample_id)
    return (m.group(1), int(m.group(2))) if m else (sample_id, -1)


def row_name(row: dict) -> str:
    extra = ",".join(f"{k.removeprefix('method.')}={v}" for k, v in sorted(row.get("overrides", {}).items()))
    return f"{row['method']} r={row['retention']:g}" + (f" [{extra}]" if extra else "")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, nargs="+", help="one or more results JSONs of the same clips")
    ap.add_argument("--references", type=Path, required=True, help="a predictions.jsonl of the same clips")
    args = ap.parse_args(argv)
    rows = [(path, i, row) for path in args.results for i, row in enumerate(json.loads(path.read_text())["rows"])]
    records = [json.loads(line) for line in args.references.read_text().splitlines() if line.strip()]
    records.sort(key=lambda r: _clip_order(r["id"]))
    ref = [wer_counts(r["reference"], "").ref_words for r in records]
    errors, left_out = {}, []
    alike = Counter(row_name(row) for _, _, row in rows)
    for path, i, row in rows:
        name = row_name(row)
        if alike[name] > 1:  # rows that their settings do not tell apart
            name += f" ({path.name} row {i})"
        per_clip = row.get("per_clip")
        if per_clip is None or len(per_clip) != len(ref):
            left_out.append(f"{name} ({len(per_clip or [])} per-clip WERs)")
            continue
        e = [w * n / 100 for w, n in zip(per_clip, ref)]
        worst = max(abs(x - round(x)) for x in e)
        if worst > 0.06:  # two-decimal WERs of a few hundred words give the integer back to within ~0.03
            sys.exit(f"intervals_from_results: row {name}: WER x reference words is {worst:.2f} from an "
                     "integer; the references are not the clips of these WERs (check the order and the data set)")
        errors[name] = ([round(x) for x in e], row)
    if not errors:
        sys.exit(f"intervals_from_results: no row has {len(ref)} per-clip WERs, the references' clips; give the "
                 "predictions of the same clips")
    if left_out:
        print(f"left out (not the references' {len(ref)} clips): " + "; ".join(left_out))
    full = next((k for k, (_, row) in errors.items() if row["method"] == "full"), None)
    pairs = [(k, full) for k in errors if full is not None and k != full]
    pairs += [(a, b) for a, b in itertools.combinations([k for k in errors if k != full], 2)
              if errors[a][1]["retention"] == errors[b][1]["retention"]]
    for a, b in pairs:
        d = paired_bootstrap_wer(errors[a][0], errors[b][0], ref)
        print(f"{a} - {b}: {d.diff:+.2f} [{d.low:+.2f}, {d.high:+.2f}] ({d.n_clips} clips)"
              + (" *" if d.excludes_zero else ""))


if __name__ == "__main__":
    main()
