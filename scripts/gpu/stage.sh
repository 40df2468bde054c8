#!/usr/bin/env bash
# One staging call on the GPU machine (the parts stay in /root/stash while the machine is warm):
#   bash scripts/gpu/stage.sh p1        [carry .stage/p1]   (then p2; both with `tree.sh out` here)
#   bash scripts/gpu/stage.sh p3        [carry .stage/p3]   joins the parts, checks them, unpacks the GGUF pieces,
#                                        the encoder, MD5SUMS and the wheels (whl/) into /root/stash
set -eu
mkdir -p /root/stash
cp .stage/"$1"/pl.part* /root/stash/
if [ "$1" = p3 ]; then
  cd /root/stash
  cat pl.part00 pl.part01 pl.part02 > payload.tar
  [ "$(md5sum < payload.tar | cut -c1-32)" = "$(cat "$OLDPWD/.stage/p3/payload.md5")" ] || { echo "payload md5 mismatch"; exit 1; }
  tar xf payload.tar && rm -f pl.part* payload.tar  # the wheels land in whl/: scripts/gpu/env.sh installs them
fi
ls -la /root/stash
