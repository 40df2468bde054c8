#!/usr/bin/env bash
# One H200 call after stage.sh p1 and p2 (carry .stage/p3): stage p3, synthesise the clips, then the jobs of
# JOBS (default scripts/gpu/sweep_jobs_ablations.txt) side by side until SWEEP_SECONDS, on the 20 test clips of
# 60-180 s of the methods table (a job's own overrides may change the clips; CLIPS names the clips to synthesise
# first, default "test:20:60:180 test:50:120:240"). The run directories (no traces) go
# to $OUT/ablation-runs.tar.gz, the log to $OUT/ablation.log; rerunning resumes every unfinished run.
#   run: bash scripts/gpu/ablation_session.sh     [carry .stage/p3, timeout_s 600]
set -uo pipefail
OUTD=${OUT:-/tmp/out}; mkdir -p "$OUTD"
bash scripts/gpu/stage.sh p3 > /dev/null || { echo "stage p3 failed"; exit 1; }
source scripts/gpu/env.sh || exit 1
t0=$(date +%s)
python3 scripts/gpu/synth_clips.py ${CLIPS:-test:20:60:180 test:50:120:240}
echo "clips at $(( $(date +%s) - t0 )) s"
python3 scripts/gpu/parallel_runs.py "${JOBS:-scripts/gpu/sweep_jobs_ablations.txt}" --parallel "${PARALLEL:-11}" \
  --seconds "${SWEEP_SECONDS:-330}" --log "$OUTD/ablation.log" -- model=whisper_smollm2 dataset=synthetic \
  dataset.text=natural dataset.n=20 dataset.min_seconds=60 dataset.max_seconds=180 runs_root=/root/stash/runs \
  progress=false device=cuda
tar czf "$OUTD/ablation-runs.tar.gz" --exclude=trace -C /root/stash runs
grep -c "exit 0" "$OUTD/ablation.log"; echo "sweep done at $(( $(date +%s) - t0 )) s"
