#!/usr/bin/env bash
# One H200 call after train_session.sh (its export in /root/stash/trained): the dev selection and the test
# measure side by side, Full Cache on the graph path (wnw-run, bf16), every run on the GPU at once:
#   dev  DEV_N clips of 2-4 min: the new weights and the tree's (the fair anchor; the choice is made on these)
#   test the 50 clips of 2-4 min: the new weights and the tree's
#   the bs-1 / bs-8 logit margins where bf16 answers part (benchmarks/batch_parity.py) on the tree's weights
# Everything in $OUT/eval_runs.tar.gz (predictions, metrics; no traces) and $OUT/eval.log.
set -uo pipefail
source scripts/gpu/env.sh || exit 1
OUTD=${OUT:-/tmp/out}; mkdir -p "$OUTD"
DEV_N=${DEV_N:-16} TEST_N=${TEST_N:-50} EVAL_S=${EVAL_S:-300}
TREE=$(realpath src/wnw_exp/backbones/whisper_smollm2) NEW=/root/stash/trained
t0=$(date +%s)
python3 scripts/gpu/synth_clips.py dev:"$DEV_N":120:240 test:"$TEST_N":120:240
echo "clips at $(( $(date +%s) - t0 )) s"
C=(model=whisper_smollm2 dataset=synthetic dataset.text=natural dataset.min_seconds=120 dataset.max_seconds=240
   method=full retention=1.0 device=cuda progress=false runs_root=/root/stash/eval_runs)
run() { timeout "$EVAL_S" python3 -m wnw_exp.cli.run "${C[@]}" "$@"; }
run dataset.split=dev dataset.n=$DEV_N model.trained_dir=$NEW > "$OUTD/dev_new.log" 2>&1 &
run dataset.split=dev dataset.n=$DEV_N model.trained_dir=$TREE > "$OUTD/dev_tree.log" 2>&1 &
run dataset.split=test dataset.n=$TEST_N model.trained_dir=$NEW > "$OUTD/test_new.log" 2>&1 &
run dataset.split=test dataset.n=$TEST_N model.trained_dir=$TREE > "$OUTD/test_tree.log" 2>&1 &
timeout "$EVAL_S" python3 benchmarks/batch_parity.py model=whisper_smollm2 model.trained_dir=$TREE dataset.split=test \
  dataset.n=16 dataset.min_seconds=120 dataset.max_seconds=240 method=full device=cuda --batch-size 8 \
  --out "$OUTD/parity.json" > "$OUTD/parity.log" 2>&1 &
wait
for f in dev_new dev_tree test_new test_tree; do echo "== $f"; grep -A1 "^model " "$OUTD/$f.log" | tail -2; done
tail -3 "$OUTD/parity.log"
tar czf "$OUTD/eval_runs.tar.gz" --exclude=trace -C /root/stash eval_runs
echo "eval done at $(( $(date +%s) - t0 )) s"
