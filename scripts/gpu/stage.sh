#!/usr/bin/env bash
# One staging call: copy the carried .stage/<part>/ files into /root/stash (they stay while the machine is warm).
#   bash scripts/gpu/stage.sh a        (then b, c: each call carries one part of <= 55 MB)
set -eu
mkdir -p /root/stash
cp -v .stage/"$1"/* /root/stash/
ls -la /root/stash
