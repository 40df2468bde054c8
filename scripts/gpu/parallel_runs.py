"""Run `wnw-run` jobs side by side on one GPU until a deadline (the bs-1 eager engine leaves the GPU mostly
idle, so several processes share it). Jobs start in file order; each gets the time left to the deadline,
then SIGINT (a run keeps every finished sample in its predictions.jsonl; rerun the same command to resume).
Job lines may name environment variables ($HEAD_SCORES). Once three jobs have failed and none has finished,
no further job starts (a cause they share, a missing module say, would otherwise spend the whole deadline).

    python3 scripts/gpu/parallel_runs.py JOBS_FILE --parallel 14 --seconds 420 -- COMMON OVERRIDES...
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobs")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--log", default=None)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, common = ap.parse_args(argv[:cut]), argv[cut + 1:]
    jobs = [shlex.split(os.path.expandvars(line)) for line in open(args.jobs) if line.strip() and not line.startswith("#")]
    deadline = time.time() + args.seconds
    log = open(args.log, "a") if args.log else sys.stdout

    done = {"ok": 0, "failed": 0}

    def run(job: list[str]) -> None:
        left = deadline - time.time()
        if done["failed"] >= min(args.parallel, 3) and not done["ok"]:  # a shared cause: do not burn the deadline
            print(f"skipped (every finished job failed): {' '.join(job)}", file=log, flush=True)
            return
        if left < 20:
            print(f"skipped (no time left): {' '.join(job)}", file=log, flush=True)
            return
        t0 = time.time()
        # a job's own value of a common key replaces it: both would name the run directory
        mine = {x.split("=", 1)[0] for x in job}
        cmd = [sys.executable, "-m", "wnw_exp.cli.run", *[x for x in common if x.split("=", 1)[0] not in mine], *job]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = p.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            p.send_signal(2)
            try:
                out, _ = p.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
        done["ok" if p.returncode in (0, 130) else "failed"] += 1
        tail = "\n    ".join(out.strip().splitlines()[-4:])
        print(f"[{time.time() - t0:6.1f} s, exit {p.returncode}] {' '.join(job)}\n    {tail}", file=log, flush=True)

    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(run, jobs))


if __name__ == "__main__":
    main()
