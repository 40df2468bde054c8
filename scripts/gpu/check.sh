#!/usr/bin/env bash
# The GPU check on your own machine, from the repository root: the CUDA-only tests, then the single-stream speed
# targets (benchmarks/decode_speed.py --gpu-check) and the serving burst (benchmarks/serving.py --gpu), into OUT_DIR.
#   bash scripts/gpu/check.sh OUT_DIR
# docs/gpu.md says how to read gpu_check.json and serving.json.
set -uo pipefail
OUTD=${1:?usage: bash scripts/gpu/check.sh OUT_DIR}; mkdir -p "$OUTD"
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUTD/gpu.log"
"$PY" -m pytest -q -p no:cacheprovider tests/test_triton_attention.py tests/test_fused_decode.py tests/test_engine.py \
  tests/test_wnw_recall_room.py tests/test_batch.py tests/test_wnw_prefill_batch.py tests/test_methods_baselines.py \
  tests/test_overlap_prefill.py 2>&1 | tail -5 | tee -a "$OUTD/gpu.log"
"$PY" benchmarks/decode_speed.py --gpu-check --out "$OUTD/gpu_check.json" 2>&1 | grep '^targets' | tee -a "$OUTD/gpu.log"
"$PY" benchmarks/serving.py --gpu --deadline-s 3600 --methods "" --graph-methods full,wnw,wnw_recall_off,adakv,arkvale \
  --lengths 4,10 --out "$OUTD/serving.json" > "$OUTD/serving.log" 2>&1
"$PY" scripts/gpu/serving_summary.py "$OUTD/serving.json" | tee -a "$OUTD/gpu.log"
