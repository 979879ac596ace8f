#!/usr/bin/env bash
# Prepared in the fortieth session, for after call_s40a.sh on the same warm machine (ideally an
# H200: 43 layers; an H100 runs 32): issue 11's acceptance figures at the binaries' defaults,
# last measured at 43 layers on an H200 in v42 — batches 1 / 16 / 64 at context 4096, verify
# 1+1..1+4 and the DSpark round, fast mode (bench's default). If call_s40a turned a form on,
# pass its environment (e.g. `DSV4_X8_OPW=1,4,1 bash tools/device/call_s40b.sh`).
#   run(command: "bash tools/device/call_s40b.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 420
MODES=fast FLASH_LAYERS=$FL bash tools/device/run.sh issue11
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cat "$S"
