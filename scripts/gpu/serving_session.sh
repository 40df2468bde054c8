#!/usr/bin/env bash
# One H200 call for issue 16 (carry .whl): the CUDA tests of the batched flush / chunk swap, the batched step's
# profile at peak (33 WnW streams), then the serving rows with CUDA graphs (SERVING_GRAPH, in order, none started
# later than SERVING_MARGIN_S before LIMIT_S; LENGTHS=4 for the 4-min scenario alone; SERVING_ARGS: more
# serving.py arguments, e.g. "--requests-4min 192"). MICRO="<copy_micro.py arguments>" also times the recall copy
# alone after the tests. Everything is packed into $OUT/serving-session.tar.gz (the device returns few files).
#   run: bash scripts/gpu/serving_session.sh     [carry .whl, timeout_s 600]
set -uo pipefail
OUTD=${OUT:-/tmp/out}; W=/tmp/serving-session; mkdir -p "$OUTD" $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=$PWD/src:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $W/gpu.log
t0=$(date +%s)
pack() { tar -czf "$OUTD/serving-session.tar.gz" -C $W . ; cp $W/*.json "$OUTD/" 2>/dev/null; }
trap pack EXIT
timeout "${TEST_S:-90}" python3 -m pytest -q -p no:cacheprovider ${TEST_FILES:-tests/test_wnw.py tests/test_fused_decode.py \
  tests/test_batch.py} -k "${TEST_K:-not smoke and (cuda or bf16 or kernel or triton or graph or batched or flush)}" \
  > $W/pytest.log 2>&1
tail -3 $W/pytest.log; echo "tests at $(( $(date +%s) - t0 )) s"
if [ -n "${MICRO:-}" ]; then
  timeout 60 python3 benchmarks/copy_micro.py $MICRO --out $W/copy_micro.json > $W/copy_micro.log 2>&1
  grep -c copy_micro $W/copy_micro.log; echo "copy micro at $(( $(date +%s) - t0 )) s"
fi
if [ -n "${PROFILE-wnw:33:3000:graph}" ]; then  # PROFILE= (empty): no profile
  timeout "${PROFILE_S:-90}" python3 benchmarks/serving.py --gpu --profile "${PROFILE:-wnw:33:3000:graph}" \
    --out $W/profile.json > $W/profile.log 2>&1
  python3 -c "import json;[print(r['method'],r['streams'],round(r['step_ms_wall_p50'],2),r['device_us_per_step'],[(t['kernel'][:28],t['us_per_step']) for t in r['top'][:6]]) for r in json.load(open('$W/profile.json')) if r.get('kind')=='profile']" 2>&1 | tail -4
  echo "profile at $(( $(date +%s) - t0 )) s"
fi
left=$(( ${LIMIT_S:-585} - ($(date +%s) - t0) ))
timeout $left python3 benchmarks/serving.py --gpu --deadline-s $(( left - ${SERVING_MARGIN_S:-110} )) --methods "" \
  --graph-methods "${SERVING_GRAPH:-full,wnw,adakv,arkvale,wnw_recall_off}" --lengths "${LENGTHS:-4,10}" \
  ${SERVING_ARGS:-} --out $W/serving.json > $W/serving.log 2>&1
python3 scripts/gpu/serving_summary.py $W/serving.json | cut -c1-400; echo "serving at $(( $(date +%s) - t0 )) s"
