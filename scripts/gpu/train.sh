#!/usr/bin/env bash
# Continue training whisper_smollm2's projector and LoRA adapters on your own GPU (the recipe of the shipped
# weights, MODEL_CARD.md), export the weights, then choose on dev clips: Full Cache on DEV_N dev clips of 2-4 min
# with the new weights and with the starting ones, side by side. From the repository root:
#   bash scripts/gpu/train.sh RUN_DIR            # then: wnw-run model.trained_dir=RUN_DIR/trained ...
# Settings: MIN (minutes of training, 7), INIT (starting weights: the shipped folder), DEV_N (16), LR (5e-4),
# LORA_LR (1.5e-4), FRAME_LOSS (0.3), SHUFFLE (0.5), CORRUPT (0.1), STAGES ('[[1.0,20,240]]'), WORKERS (14: clip
# synthesis processes), VOICES (six: a preset of src/wnw_exp/data/voices.py, e.g. train_wide), SIX_SHARE (0: the
# share of clips the six voices keep whatever VOICES says), TEXTS (natural),
# AUGMENT (off | light: needs pip install -e '.[augment]'). A second call with the same RUN_DIR resumes from
# RUN_DIR/state.pt (weights and optimizer; INIT is read only by the first), so a long run is a series of calls of
# MIN minutes each. The wide mixture, continuing from the shipped weights:
#   VOICES=train_wide AUGMENT=light bash scripts/gpu/train.sh RUN_DIR   # repeat until the dev WER stops improving
set -euo pipefail
RUN=${1:?usage: bash scripts/gpu/train.sh RUN_DIR}
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
INIT=${INIT:-src/wnw_exp/backbones/whisper_smollm2} DEV_N=${DEV_N:-16}
"$PY" -m wnw_exp.train.projector train --run-dir "$RUN" --init-from "$INIT" --minutes "${MIN:-7}" --total-steps 100000 \
  --workers "${WORKERS:-14}" --batch-windows 32 --log-every 25 --lora-rank 16 --lr "${LR:-5e-4}" \
  --lora-lr "${LORA_LR:-1.5e-4}" --frame-loss "${FRAME_LOSS:-0.3}" --shuffle-words "${SHUFFLE:-0.5}" \
  --corrupt-inputs "${CORRUPT:-0.1}" --stages "${STAGES:-[[1.0,20,240]]}" --voices "${VOICES:-six}" \
  --texts "${TEXTS:-natural}" --augment "${AUGMENT:-off}" --six-share "${SIX_SHARE:-0}"
"$PY" -m wnw_exp.train.projector export --run-dir "$RUN" --out "$RUN/trained"
# The choice, on dev clips only (never the test clips): the new weights against the starting ones.
"$PY" scripts/gpu/synth_clips.py dev:"$DEV_N":120:240
DEV=(model=whisper_smollm2 dataset=synthetic dataset.text=natural dataset.split=dev dataset.n="$DEV_N"
     dataset.min_seconds=120 dataset.max_seconds=240 method=full retention=1.0 device=cuda progress=false)
"$PY" -m wnw_exp.cli.run "${DEV[@]}" model.trained_dir="$RUN/trained" runs_root="$RUN/dev_new" > "$RUN/dev_new.log" 2>&1 &
"$PY" -m wnw_exp.cli.run "${DEV[@]}" model.trained_dir="$(realpath "$INIT")" runs_root="$RUN/dev_init" > "$RUN/dev_init.log" 2>&1 &
wait
grep -h -A1 "^model " "$RUN"/dev_new.log "$RUN"/dev_init.log
