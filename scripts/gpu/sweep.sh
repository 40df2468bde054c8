#!/usr/bin/env bash
# A sweep of whisper_smollm2 on your own GPU, many wnw-run processes side by side (a single stream leaves a large
# GPU mostly idle): the clips once, WnW's head scores from 50 calibration clips, then one wnw-run per line of JOBS on
# N test clips of 60-180 s, then the report. A job that is cut by SECONDS keeps its finished clips: run the same
# command again to resume it. From the repository root:
#   bash scripts/gpu/sweep.sh                                              # the methods table (sweep_jobs.txt)
#   JOBS=scripts/gpu/sweep_jobs_ablations.txt bash scripts/gpu/sweep.sh    # A1 / A2, and Full in fp32 on 50 clips of 2-4 min
#   JOBS=scripts/gpu/sweep_jobs_50.txt N=50 MAX_S=240 EXTRA="batch_size=50 kv_pool_gb=6 kv_host_gb=4" PARALLEL=8 \
#     bash scripts/gpu/sweep.sh                   # the methods table and its bound on 50 clips of 1-4 min, 0.1-0.4
# Settings: JOBS, PARALLEL (14), DEADLINE_S (for all the jobs, 3600), N (20), MIN_S / MAX_S (the clips' length range
# in s, 60 / 180), EXTRA (overrides every job gets, e.g. batch_size), RUNS (outputs/runs), HEAD_SCORES (where the
# head scores go; an existing file is reused, e.g. src/wnw_exp/calibration/shipped/whisper_smollm2.json), CLIPS (the
# clips to synthesise first; the ablations' fp32 job also reads the 50 test clips of 2-4 min:
# CLIPS="calib:50:60:240 test:20:60:180 test:50:120:240").
set -euo pipefail
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
JOBS=${JOBS:-scripts/gpu/sweep_jobs.txt} PARALLEL=${PARALLEL:-14} DEADLINE_S=${DEADLINE_S:-3600} N=${N:-20}
MIN_S=${MIN_S:-60} MAX_S=${MAX_S:-180}
RUNS=${RUNS:-outputs/runs}
export HEAD_SCORES=${HEAD_SCORES:-outputs/head_scores/whisper_smollm2.json}  # the job lines name $HEAD_SCORES
"$PY" scripts/gpu/synth_clips.py ${CLIPS:-calib:50:60:240 test:$N:$MIN_S:$MAX_S}
if [ ! -f "$HEAD_SCORES" ]; then
  mkdir -p "$(dirname "$HEAD_SCORES")"
  "$PY" -m wnw_exp.cli.calibrate model=whisper_smollm2 dataset.text=natural dataset.split=calib dataset.n=50 \
    dataset.min_seconds=60 dataset.max_seconds=240 recall_samples=6 device=cuda output="$HEAD_SCORES" progress=false
fi
"$PY" scripts/gpu/parallel_runs.py "$JOBS" --parallel "$PARALLEL" --seconds "$DEADLINE_S" -- model=whisper_smollm2 \
  dataset=synthetic dataset.text=natural dataset.n="$N" dataset.min_seconds="$MIN_S" dataset.max_seconds="$MAX_S" \
  runs_root="$RUNS" progress=false device=cuda ${EXTRA:-}
"$PY" -m wnw_exp.cli.report --runs "$RUNS" --models whisper_smollm2
