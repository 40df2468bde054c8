#!/usr/bin/env bash
# `make figures`: every table and figure of the paper, from run directories only (wnw-report).
#
# With no run directory under $RUNS it first runs a small sweep on the tiny model so that a fresh clone
# produces everything: the methods of conf/method/ at r_GPU = 0.2, 0.4, 0.6, 0.8, Full Cache once, and
# the §2.1 mismatch analysis (Full Cache, analysis=mismatch), on a few synthetic clips. With run
# directories present it only reports. The tiny model stands in for the paper's backbones and the
# synthetic test split for LibriSpeech-Long test-clean (see the report's notes); nothing is filled in.
#
# Settings (environment): FIGURES_MODEL (tiny), FIGURES_N clips (2), FIGURES_MIN_SECONDS (60),
# FIGURES_MAX_SECONDS (80), FIGURES_METHODS, FIGURES_JOBS parallel runs (2; the joblib launcher when
# hydra-joblib-launcher is installed), FIGURES_ARGS (extra wnw-run overrides, space-separated),
# RUNS (outputs/runs), OUT (outputs/report), BIN (.venv/bin).
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-.venv/bin}
RUNS=${RUNS:-outputs/runs}
OUT=${OUT:-outputs/report}
MODEL=${FIGURES_MODEL:-tiny}
N=${FIGURES_N:-2}
MIN_S=${FIGURES_MIN_SECONDS:-60}
MAX_S=${FIGURES_MAX_SECONDS:-80}
JOBS=${FIGURES_JOBS:-2}
METHODS=${FIGURES_METHODS:-adakv,audiokv,arkvale,affpool,wnw}
failed=()

if find "$RUNS" -name predictions.jsonl -print -quit 2>/dev/null | grep -q .; then
  echo "make figures: run directories found under $RUNS; reporting only"
else
  echo "make figures: no run directory under $RUNS; a small sweep on model=$MODEL first"
  methods=()
  for m in ${METHODS//,/ }; do
    if [ -f "conf/method/$m.yaml" ]; then methods+=("$m"); else echo "  (no conf/method/$m.yaml: $m left out)" >&2; fi
  done
  launcher=()
  if [ "$JOBS" -gt 1 ] && "$BIN/python" -c "import hydra_plugins.hydra_joblib_launcher" 2>/dev/null; then
    launcher=(hydra/launcher=joblib "hydra.launcher.n_jobs=$JOBS")
  fi
  # One torch thread per run. A decode step of the tiny model is many small ops; with several threads
  # each op waits for the others, and on a busy machine that wait dominates (measured on 2 shared cores:
  # 3,100 ms/token with 2 threads, 33 ms/token with 1).
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  read -r -a extra <<< "${FIGURES_ARGS:-}"
  common=("model=$MODEL" dataset=synthetic "dataset.n=$N" "dataset.min_seconds=$MIN_S"
          "dataset.max_seconds=$MAX_S" "runs_root=$RUNS" progress=false "${extra[@]}")
  export WNW_NO_PROGRESS=1 HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
  start=$(date +%s)
  # one sweep per method, so that a method that cannot run here (e.g. no head scores for the model) costs
  # only its own cells; the report lists them as missing
  for m in "${methods[@]}"; do
    "$BIN/wnw-run" -m "${launcher[@]}" "${common[@]}" "method=$m" retention=0.2,0.4,0.6,0.8 || failed+=("$m")
  done
  "$BIN/wnw-run" -m "${launcher[@]}" "${common[@]}" method=full retention=1.0 analysis=null,mismatch \
    || failed+=("full")
  echo "make figures: sweep done in $(( $(date +%s) - start )) s"
fi

"$BIN/python" -m wnw_exp.cli.report --runs "$RUNS" --out "$OUT"
if [ ${#failed[@]} -gt 0 ]; then
  echo "make figures: the sweep failed for: ${failed[*]} (their cells are blank; see the errors above)" >&2
  exit 1
fi
