#!/usr/bin/env bash
# Here (not on the GPU machine): make the working tree small enough for a staging call, and restore it after.
# A device call carries the working tree with its carried paths, 64 MiB in all; the tracked weights of
# whisper_smollm2 (16 MB) leave no room for a 57 MB staging part (docs/gpu.md).
#   bash scripts/gpu/tree.sh out    move whisper_smollm2's trained weights to $PARK
#   bash scripts/gpu/tree.sh back   put them back (git checkout of the tracked files) before tests/commits
set -euo pipefail
cd "$(dirname "$0")/../.."
PARK=${PARK:-/tmp/wnw-parked-weights}
case "${1:-}" in
  out)
    mkdir -p "$PARK/whisper_smollm2"
    mv src/wnw_exp/backbones/whisper_smollm2/*.safetensors "$PARK/whisper_smollm2/" 2>/dev/null || true
    du -sh --exclude=.git --exclude=.venv --exclude=.stage --exclude=.whl --exclude=outputs . ;;
  back)
    # only what is missing comes back: an export copied into the tree since (not yet committed) is never overwritten
    for f in lora.safetensors projector.safetensors; do
      dst=src/wnw_exp/backbones/whisper_smollm2/$f
      [ -e "$dst" ] && continue
      if [ -e "$PARK/whisper_smollm2/$f" ]; then mv "$PARK/whisper_smollm2/$f" "$dst"; else git checkout -- "$dst"; fi
    done
    git status --short src/wnw_exp/backbones/ ;;
  *) echo "usage: bash scripts/gpu/tree.sh out | back"; exit 2 ;;
esac
