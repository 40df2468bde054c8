#!/usr/bin/env bash
# One H200 call for issues 15 and 16, from the repository root, carrying .whl (docs/gpu.md): the CUDA-path tests,
# the engine check (decode_speed.py --gpu-check: Voxtral at 3,000 and 12,000 audio tokens, the Qwen2.5-Omni
# runner rows) and the serving benchmark (every method, then the graph rows). Each part has its own time limit
# so one that hangs leaves the others their rows; everything lands in $OUT (PROFILE=24: a torch.profiler row of WnW
# and ArkVale at 3,000 tokens and of WnW at 12,000). The limits add up to 11.5 minutes, so the call's 600 s cuts the
# serving part (each method's two scenarios take ~100 s on the H200: choose them with SERVING_GRAPH / SERVING_EAGER,
# "" for none; the fourth session's call ran out during ArkVale's). Run it with timeout_s 600:
#   run: bash scripts/gpu/engine_session.sh     [carry .whl]    (then copy $OUT's files to benchmarks/results/)
set -uo pipefail
OUTD=${OUT:-/tmp/out}; mkdir -p "$OUTD"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=$PWD/src:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUTD/gpu.log"
t0=$(date +%s)
timeout "${TEST_S:-100}" python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py \
  tests/test_fused_decode.py tests/test_wnw_recall_room.py tests/test_batch.py \
  -k "not smoke and (not test_batch or kernel or triton or cuda or bf16)" > "$OUTD/pytest.log" 2>&1
tail -4 "$OUTD/pytest.log"; echo "tests at $(( $(date +%s) - t0 )) s"
# --hf-steps 0: transformers' anchors were measured on 2026-12-01 (gpu-check.json); HF_STEPS=64 measures them again
timeout "${CHECK_S:-200}" python3 benchmarks/decode_speed.py --gpu-check --hf-steps "${HF_STEPS:-0}" --profile "${PROFILE:-24}" \
  --out "$OUTD/gpu_check.json" \
  > "$OUTD/gpu_check.log" 2>&1
grep '^targets' "$OUTD/gpu_check.log" | cut -c1-900; echo "check at $(( $(date +%s) - t0 )) s"
# the graph rows of the four methods first (the GPU's real speed; eager steps are host-bound), WnW recall-off last
timeout "${SERVING_S:-390}" python3 benchmarks/serving.py --gpu --deadline-s "${SERVING_DEADLINE_S:-300}" \
  --methods "${SERVING_EAGER-wnw_recall_off}" --graph-methods "${SERVING_GRAPH-full,wnw,adakv,arkvale}" \
  --out "$OUTD/serving.json" > "$OUTD/serving.log" 2>&1
grep '"kind": "throughput"' "$OUTD/serving.log" | cut -c1-260; echo "serving at $(( $(date +%s) - t0 )) s"
