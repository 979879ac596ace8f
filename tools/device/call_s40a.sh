#!/usr/bin/env bash
# Prepared in the thirty-ninth session (PERF.md v48's Next), any GPU, ~6 minutes, with
# .devbin/ptx (keep_ptx.sh with the environment forms below: every process loads kept cubins).
# The experts table for the one-row expert forms call_s39b.sh did not reach (moe_down1s at 2 and
# 4 outputs a warp, alone and with moe_up1s at 4; DOWN1_PAIRS; v44's kernel directories), then
# batch 1 alternating the built-in kernels and the two forms with the lowest one-row DRAM
# figure that beat it by > 1 µs, the best one's bitwise check, batches 16 / 64 with the
# built-in kernels and with the best (a default must not cost the batches), then cuda_gguf,
# then the one-row products' table at 4 outputs a warp against the built-in.
#   run(command: "bash tools/device/call_s40a.sh", carry: ["devbin.tar.xz"])
# VARIANTS overrides the list (names of run_test.sh's `variant_env`).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 420
export DSV4_BIN=.devbin/dsv4
# A layer's latency-bound stages alone (new, v48): HC_PRE + norm, HC_POST, the router, a norm.
TABLES=stages experts_table stages
vs=${VARIANTS:-dn2b3 dn4b2 up4dn2b3 up4dn4b2 dn2 dn4 up4 dnp up4dn2 up4dn4 up2dn2 up4b dn5bp sel16 pf512}
experts_table base
# shellcheck disable=SC2086
BUDGET=$((LIMIT - 170)) experts_variants $T0 $vs base2
# shellcheck disable=SC2086
best=$(experts_best $vs)
if [ -n "$best" ]; then
  # shellcheck disable=SC2086
  ab_variants $best
  for v in base ${best%% *}; do
    # shellcheck disable=SC2046
    t && ( export $(variant_env $v) X=; echo "batches with $v:" >> "$S"; batches_16_64 $FL; mv "$OUT/b1664.txt" "$OUT/b1664-$v.txt" )
  done
fi
t && run_test cuda_gguf
# The one-row products at 4 outputs a warp: wo_a's codes then need no ticket (v48).
# shellcheck disable=SC2046
t && TABLES=onerow experts_table gemv4 $(variant_env gemv4)
t && TABLES=onerow experts_table onerow-base
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cat "$S"
