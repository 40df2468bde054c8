"""The testbed's properties (attention sinks, sparse heads, sparse voice scores) of one or more head-score files,
side by side: `HeadScores.properties` of each, printed and optionally written as JSON.

    python scripts/testbed_properties.py outputs/calibration/whisper_smollm2/*/head_scores.json [--out props.json]

A file from `wnw-calibrate` on the clips to compare (e.g. held-out voices and text against the training kind, the
same lengths and n) holds what is needed; `recall_samples=0` skips the decoding it does not need.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from wnw_exp.head_scores import HeadScores, HeadScoresError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default=None, help="write {file: properties} here as JSON")
    a = ap.parse_args(argv)
    out = {}
    for f in a.files:
        try:
            out[f] = HeadScores.load(f).properties()
        except HeadScoresError as e:
            print(f"testbed_properties: {e}", file=sys.stderr)
            return 2
    for f, p in out.items():
        lo, hi = p["first_token_layers"]
        print(f"{f}\n  first-token share, layers {lo}-{hi}: {p['first_token']:.3f}; KV heads above 0.3: "
              f"{p['sink_heads']}/{p['n_kv_heads_total']}; 90% of a head's audio mass in a median "
              f"{100 * p['audio_positions_90']:.1f}% of the positions; voice scores top "
              f"{', '.join(f'{v:.2f}' for v in p['voice_score_top3'])}, median {p['voice_score_median']:.4f}")
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
