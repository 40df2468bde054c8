#!/usr/bin/env bash
# One H200 session for model=whisper_smollm2, from the repository root after the three staging calls
# (docs/gpu.md): continue training the projector and the LoRA adapters (rank 16 on every linear layer of the
# decoder) from INIT (default: the shipped folder) for MIN minutes on natural-text synthetic speech, export
# them to $OUT at once (trained.tar), then a dev eval on DEV_N clips of 2-4 min (wnw-run, Full Cache, bf16) with
# at most EVAL_S seconds. Everything also stays in /root/stash for a following call on the same machine.
# FRAME_LOSS > 0 adds the frame loss; STAGES (JSON, see --stages) overrides the clip-length schedule; LR/LORA_LR the peak
# learning rates; SHUFFLE the share of training clips whose words are spoken in a random order. The dev predictions are
# written clip by clip (a cut-short eval keeps what it decoded). CORRUPT: the share of teacher-forced answer inputs
# replaced by another token of the answer (--corrupt-inputs). ANCHOR=1 evaluates INIT's weights on the same dev clips
# side by side with the new ones (two processes on the GPU), the fair anchor of the session. History: training_log.md.
set -uo pipefail
source scripts/gpu/env.sh || exit 1
MIN=${MIN:-7.0} DEV_N=${DEV_N:-16} EVAL_S=${EVAL_S:-200} WORKERS=${WORKERS:-14} FRAME_LOSS=${FRAME_LOSS:-0}
LR=${LR:-1e-3} LORA_LR=${LORA_LR:-3e-4} STAGES=${STAGES:-} SHUFFLE=${SHUFFLE:-0} CORRUPT=${CORRUPT:-0} ANCHOR=${ANCHOR:-0}
INIT=${INIT:-src/wnw_exp/backbones/whisper_smollm2}
OUTD=${OUT:-/tmp/out}; mkdir -p "$OUTD"
RUN=/root/stash/run-$(date +%H%M); CORPUS=src/wnw_exp/data/natural_text/passages.jsonl.gz
cp $CORPUS /root/stash/passages.jsonl.gz
t0=$(date +%s)
python3 -m wnw_exp.train.projector train --run-dir "$RUN" --init-from "$INIT" --minutes "$MIN" --total-steps 100000 \
  --workers "$WORKERS" --batch-windows 32 --log-every 25 --lora-rank 16 --lr "$LR" --lora-lr "$LORA_LR" --frame-loss "$FRAME_LOSS" \
  --shuffle-words "$SHUFFLE" --corrupt-inputs "$CORRUPT" \
  ${STAGES:+--stages "$STAGES"}
echo "trained at $(( $(date +%s) - t0 )) s"
python3 -m wnw_exp.train.projector export --run-dir "$RUN" --out /root/stash/trained
tar cf "$OUTD/trained.tar" -C /root/stash trained
cp "$RUN/train_log.jsonl" "$OUTD/" 2>/dev/null
# dev selection: Full Cache with wnw-run (the graph path, ~2 ms a token) on DEV_N dev clips of 2-4 min, the new
# weights and (ANCHOR=1) INIT's side by side; predictions and metrics in $OUT/dev_runs.tar.gz. EVAL_S=0: none (the
# whole call for training; scripts/gpu/eval_session.sh makes the choice in the next call)
[ "$EVAL_S" -gt 0 ] || { echo "session done at $(( $(date +%s) - t0 )) s (no dev eval)"; exit 0; }
python3 scripts/gpu/synth_clips.py dev:"$DEV_N":120:240
DEV=(model=whisper_smollm2 dataset=synthetic dataset.text=natural dataset.split=dev dataset.n=$DEV_N dataset.min_seconds=120
     dataset.max_seconds=240 method=full retention=1.0 device=cuda progress=false runs_root=/root/stash/dev_runs)
timeout "$EVAL_S" python3 -m wnw_exp.cli.run "${DEV[@]}" model.trained_dir=/root/stash/trained > "$OUTD/dev_new.log" 2>&1 &
[ "$ANCHOR" = 1 ] && timeout "$EVAL_S" python3 -m wnw_exp.cli.run "${DEV[@]}" model.trained_dir="$(realpath "$INIT")" \
  > "$OUTD/dev_anchor.log" 2>&1 &
wait
grep -h -A1 "^model " "$OUTD"/dev_*.log
tar czf "$OUTD/dev_runs.tar.gz" --exclude=trace -C /root/stash dev_runs
echo "session done at $(( $(date +%s) - t0 )) s"
