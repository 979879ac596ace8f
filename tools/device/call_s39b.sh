#!/usr/bin/env bash
# Prepared in the thirty-ninth session (PERF.md v48), any GPU, ~5 minutes, with .devbin/ptx
# (keep_ptx.sh: every process loads PTX instead of compiling). v44's one-row expert variants
# (xa, ptab, sel16, pf512, up4b, dn5b with DSV4_DOWN1_PAIRS=1) and the outputs a warp
# (DSV4_X8_OPW's UP / DOWN, with X8_PIPE) were only ever timed by the
# experts table on the f32 kernels (v48): here on the step's int8 ones, then batch 1 alternating
# the built-in kernels and the two variants with the lowest one-row DRAM figure that beat it,
# the best one's bitwise check, then cuda_backend and batches 16 / 64.
#   run(command: "bash tools/device/call_s39b.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 400
export DSV4_BIN=.devbin/dsv4
experts_table base
BUDGET=$((LIMIT - 90)) experts_variants $T0 up2 up4 xa ptab up2p dn2 dnp up4b dn5bp sel16 pf512 base2
best=$(experts_best xa ptab up2 up4 up2p dn2 dnp up4b dn5bp sel16 pf512)
# shellcheck disable=SC2086
[ -n "$best" ] && ab_variants $best
t && run_test cuda_backend
t && batches_16_64 $FL
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cat "$S"
