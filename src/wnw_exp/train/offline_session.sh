#!/bin/bash
# One training session of the tiny model on a GPU machine without network (README: "Training the tiny model").
#
#   WHEELS=dir CKPT_IN=dir CKPT_OUT=dir bash src/wnw_exp/train/offline_session.sh MINUTES TOTAL_STEPS [EVAL_CLIPS]
#
# Run from the repository root. WHEELS: a folder of wheels for that machine's Python (the packages the
# training needs beyond torch/transformers/tokenizers/numpy: espeakng-loader, soxr, soundfile, cffi,
# pycparser, jiwer, rapidfuzz, and wordfreq with ftfy, wcwidth, langcodes, locate), installed into
# /tmp/site; a folder WHEELS/stub is put on the path too, if present. TRAIN_ARGS: more arguments of
# `wnw-train-tiny train` (e.g. `--init-from src/wnw_exp/backbones/tiny_model --init-heads heads.pt`). The run directory is
# RUN_DIR (default /tmp/train-tiny); when it holds no checkpoint, it is restored from the
# `ckpt.part*` pieces in CKPT_IN. At the end the run directory (state.pt and logs) is written to
# CKPT_OUT as 15 MB pieces `ckpt.part*` (join them with `cat ckpt.part* | tar x -C RUN_DIR`).
set -u
RUN=${RUN_DIR:-/tmp/train-tiny}
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${WHEELS}/stub:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 WNW_CACHE=${WNW_CACHE:-/tmp/wnwcache}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ ! -f "$RUN/state.pt" ] && [ -n "${CKPT_IN:-}" ] && ls "$CKPT_IN"/ckpt.part* >/dev/null 2>&1; then
  mkdir -p "$RUN" && cat "$CKPT_IN"/ckpt.part* | tar x -C "$RUN" && echo "restored $RUN from $CKPT_IN"
fi
python3 -m wnw_exp.train.tiny train --run-dir "$RUN" --minutes "$1" --total-steps "$2" \
  --workers "${WORKERS:-$(( $(nproc) - 2 ))}" --eval-clips "${3:-4}" ${TRAIN_ARGS:-} 2>&1 | tee "${CKPT_OUT:-$RUN}/train_stdout.txt"
if [ -n "${CKPT_OUT:-}" ]; then
  (cd "$RUN" && tar cf - state.pt train_log.jsonl $(ls eval_log.jsonl 2>/dev/null)) | split -b 15M - "$CKPT_OUT/ckpt.part"
fi
