#!/usr/bin/env bash
# One H200 session after train_session.sh (the trained folder in /root/stash/trained): wnw-calibrate on the 50
# calibration clips, then the methods table (scripts/gpu/sweep_jobs.txt) on 20 test clips of 60-180 s, many
# wnw-run processes side by side until the deadline. $OUT gets runs.tar.gz (run directories, head scores) and
# the log. Settings: SWEEP_SECONDS (deadline of the sweep), PARALLEL, N clips.
set -uo pipefail
source scripts/gpu/env.sh || exit 1
OUTD=${OUT:-/tmp/out}; mkdir -p "$OUTD"
t0=$(date +%s)
cp /root/stash/passages.jsonl.gz src/wnw_exp/data/natural_text/passages.jsonl.gz 2>/dev/null
MODEL=(model=whisper_smollm2 model.trained_dir=/root/stash/trained)
export HEAD_SCORES=/root/stash/head_scores.json
python3 scripts/gpu/synth_clips.py calib:50:60:240 test:${N:-20}:60:180  # the clips once, in parallel
echo "clips at $(( $(date +%s) - t0 )) s"
python3 -m wnw_exp.cli.calibrate "${MODEL[@]}" dataset.text=natural dataset.split=calib dataset.n=50 dataset.min_seconds=60 \
  dataset.max_seconds=240 recall_samples=${RECALL_SAMPLES:-6} output=/root/stash/head_scores.json progress=false \
  calibration_root=/root/stash/calibration device=cuda 2>&1 | tail -4
echo "calibration at $(( $(date +%s) - t0 )) s"
python3 scripts/gpu/parallel_runs.py "${JOBS:-scripts/gpu/sweep_jobs.txt}" --parallel "${PARALLEL:-14}" \
  --seconds "${SWEEP_SECONDS:-380}" --log "$OUTD/sweep_log.txt" -- "${MODEL[@]}" dataset=synthetic dataset.text=natural \
  dataset.n=${N:-20} dataset.min_seconds=60 dataset.max_seconds=180 runs_root=/root/stash/runs progress=false \
  device=cuda
echo "sweep at $(( $(date +%s) - t0 )) s"
tar czf "$OUTD/runs.tar.gz" -C /root/stash runs calibration head_scores.json
ls -la "$OUTD"
