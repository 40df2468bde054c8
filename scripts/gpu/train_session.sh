#!/usr/bin/env bash
# One H200 session for model=whisper_smollm2 (run from the repo root after the staging calls; ~9.5 min):
# 1. the train split of the natural-text corpus, written by SmolLM2 on the GPU (the held-out splits are in the repo);
# 2. stage A: the projector alone (A_MIN minutes); eval on DEV_N dev clips of 2-4 min;
# 3. stage B, only if that dev WER is above LORA_IF_WER: LoRA rank 16 on the decoder's attention + the projector
#    (B_MIN minutes); eval again;
# 4. export, and the Full-cache WER of the 50 test clips of 2-4 min by plain generate() (H200, bf16).
# Everything stays in /root/stash for the next call; $OUT gets the corpus, the trained folder and the logs.
set -uo pipefail
source scripts/gpu/env.sh || exit 1
A_MIN=${A_MIN:-3.5} B_MIN=${B_MIN:-2.0} LORA_IF_WER=${LORA_IF_WER:-8} DEV_N=${DEV_N:-12} WORKERS=${WORKERS:-14}
OUTD=${OUT:-/tmp/out}; mkdir -p "$OUTD"
RUN=/root/stash/run; CORPUS=src/wnw_exp/data/natural_text/passages.jsonl.gz
T=python3
t0=$(date +%s)
$T -m wnw_exp.data.natural_text generate --splits train --device cuda --batch-size 512 --out $CORPUS && cp $CORPUS "$OUTD/" \
  && cp $CORPUS /root/stash/passages.jsonl.gz
$T -m wnw_exp.data.natural_text stats --out $CORPUS
echo "corpus done at $(( $(date +%s) - t0 )) s"
$T -m wnw_exp.train.projector train --run-dir $RUN --minutes "$A_MIN" --total-steps 100000 --workers "$WORKERS" \
  --batch-windows 32 --log-every 25
dev() { $T -m wnw_exp.train.projector eval --run-dir $RUN --n "$DEV_N" --split dev --min-seconds 120 --max-seconds 240 \
  --predictions "$RUN/dev_$1.jsonl"; }
dev a
wer=$($T -c "import json; print(json.loads(open('$RUN/eval_log.jsonl').read().splitlines()[-1])['wer'])")
echo "stage A dev WER $wer at $(( $(date +%s) - t0 )) s"
if $T -c "import sys; sys.exit(0 if $wer > $LORA_IF_WER else 1)"; then
  cp -r $RUN /root/stash/run_projector_only
  $T -m wnw_exp.train.projector train --run-dir $RUN --minutes "$B_MIN" --total-steps 100000 --workers "$WORKERS" \
    --batch-windows 32 --log-every 25 --lora-rank 16 --lr 3e-4
  dev b
fi
$T -m wnw_exp.train.projector export --run-dir $RUN --out /root/stash/trained
$T -m wnw_exp.train.projector eval --trained-dir /root/stash/trained --n 50 --split test --min-seconds 120 \
  --max-seconds 240 --predictions /root/stash/trained/test_full_h200.jsonl | tee /root/stash/trained/test_full_h200.txt
cp $RUN/dev_*.jsonl /root/stash/trained/ 2>/dev/null
tar cf "$OUTD/trained.tar" -C /root/stash trained
echo "session done at $(( $(date +%s) - t0 )) s"
