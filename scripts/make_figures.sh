#!/usr/bin/env bash
# `make figures`: every table and figure of the paper, from run directories only (wnw-report).
#
# First the sweep the figures need, on the embedded model: every method of src/wnw_exp/conf/method/ at r_GPU = 0.2, 0.4,
# 0.6, 0.8 (the oracle bound at both granularities), Full Cache once, and the §2.1 mismatch analysis (Full Cache,
# analysis=mismatch), on a few synthetic clips. It always runs: a run that is already complete is resumed,
# which decodes nothing ("k of n samples already done"), and one that is missing is made, whatever else
# exists under $RUNS. The clips are the data set's defaults, so the run `make run` made is reused as the WnW
# 0.2 point. Then the report. The embedded model stands in for the paper's backbones and the synthetic test split
# for LibriSpeech-Long test-clean (see the report's notes); nothing is filled in.
#
# Settings (environment): FIGURES_MODEL (whisper_smollm2), FIGURES_N clips (2), FIGURES_METHODS (every method/ config
# but full), FIGURES_JOBS parallel runs (2; the joblib launcher when hydra-joblib-launcher is installed),
# FIGURES_ARGS (extra wnw-run overrides, space-separated), FIGURES_SWEEP (1; 0 = report only), RUNS
# (outputs/runs), OUT (outputs/report), BIN (.venv/bin).
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-.venv/bin}
RUNS=${RUNS:-outputs/runs}
OUT=${OUT:-outputs/report}
MODEL=${FIGURES_MODEL:-whisper_smollm2}
N=${FIGURES_N:-2}
JOBS=${FIGURES_JOBS:-2}
CONF=${WNW_CONF:-src/wnw_exp/conf}  # the config groups wnw-run reads (wnw_exp.paths.conf_dir)
all_methods=$(for f in "$CONF"/method/*.yaml; do n=$(basename "$f" .yaml); [ "$n" = full ] || printf '%s,' "$n"; done)
METHODS=${FIGURES_METHODS:-${all_methods%,}}
failed=()

if [ "${FIGURES_SWEEP:-1}" = 1 ]; then
  methods=()
  for m in ${METHODS//,/ }; do
    if [ -f "$CONF/method/$m.yaml" ]; then methods+=("$m"); else echo "  (no $CONF/method/$m.yaml: $m left out)" >&2; fi
  done
  launcher=()
  if [ "$JOBS" -gt 1 ] && "$BIN/python" -c "import hydra_plugins.hydra_joblib_launcher" 2>/dev/null; then
    launcher=(hydra/launcher=joblib "hydra.launcher.n_jobs=$JOBS")
  fi
  # One torch thread per run. A decode step of a small model is many small ops; with several threads each op
  # waits for the others, and on a busy machine that wait dominates (measured on 2 shared cores with the
  # retired 10 M-parameter tiny model: 3,100 ms/token with 2 threads, 33 ms/token with 1).
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  read -r -a extra <<< "${FIGURES_ARGS:-}"
  common=("model=$MODEL" dataset=synthetic "dataset.n=$N" "runs_root=$RUNS" progress=false "${extra[@]}")
  export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
  # one sweep per method, so that a method that cannot run here (e.g. no head scores for the model) costs
  # only its own cells; the report lists them as missing
  sweeps=$(( ${#methods[@]} + 1 ))
  runs=$(( 4 * ${#methods[@]} + 2 ))
  for m in "${methods[@]}"; do [ "$m" = oracle ] && runs=$(( runs + 4 )); done
  echo "make figures: $runs runs on model=$MODEL (synthetic clips per run: $N) in $sweeps sweeps, $JOBS at a time," \
       "into $RUNS; complete runs are only resumed"
  start=$(date +%s)
  i=0
  for m in "${methods[@]}"; do
    i=$(( i + 1 ))
    axis=()
    [ "$m" = oracle ] && axis=(method.granularity=token,chunk)  # the bound per token and per 4 s block
    echo "make figures: sweep $i of $sweeps: $m at r_GPU 0.2, 0.4, 0.6, 0.8 ${axis[*]} ($(( $(date +%s) - start )) s)"
    "$BIN/wnw-run" -m "${launcher[@]}" "${common[@]}" "method=$m" retention=0.2,0.4,0.6,0.8 "${axis[@]}" \
      || failed+=("$m")
  done
  echo "make figures: sweep $sweeps of $sweeps: Full Cache, plain and with the mismatch analysis" \
       "($(( $(date +%s) - start )) s)"
  "$BIN/wnw-run" -m "${launcher[@]}" "${common[@]}" method=full analysis=null,mismatch || failed+=("full")
  echo "make figures: the sweep took $(( $(date +%s) - start )) s; the report:"
fi

"$BIN/python" -m wnw_exp.cli.report --runs "$RUNS" --out "$OUT"
if [ ${#failed[@]} -gt 0 ]; then
  echo "make figures: the sweep failed for: ${failed[*]} (their cells are blank; see the errors above)" >&2
  exit 1
fi
