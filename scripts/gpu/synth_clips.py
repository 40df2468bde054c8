"""Synthesise data-set clips once, in parallel, into the shared FLAC cache, so that the wnw-run processes started
after it (side by side on the GPU machine) read them instead of each synthesising the same clips.

    python3 scripts/gpu/synth_clips.py SPLIT:N:MIN_S:MAX_S [...]     e.g. test:20:60:180 calib:50:60:240
"""

import sys
from multiprocessing import Pool

from wnw_exp.data.synthetic import SyntheticDataset


def _one(job):
    split, n, lo, hi, i = job
    SyntheticDataset(text="natural", split=split, n=n, min_seconds=lo, max_seconds=hi)[i]


if __name__ == "__main__":
    jobs = []
    for spec in sys.argv[1:]:
        split, n, lo, hi = spec.split(":")
        jobs += [(split, int(n), float(lo), float(hi), i) for i in range(int(n))]
    with Pool(16) as p:
        p.map(_one, jobs)
