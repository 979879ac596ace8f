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
fig() { grep -E '^experts 1 rows, dram' "$OUT/experts-$1.txt" 2>/dev/null | grep -m1 -oE '[0-9.]+ µs a call' | cut -d' ' -f1; }
b=$( (fig base; fig base2) | sort -n | head -1)
best=$(for v in xa ptab up2 up4 up2p dn2 dnp up4b dn5bp sel16 pf512; do f=$(fig $v); [ -n "$f" ] && [ -n "$b" ] \
  && awk -v f="$f" -v b="$b" 'BEGIN{exit !(f < b - 1)}' && echo "$f $v"; done | sort -n | head -2 | cut -d' ' -f2 | tr '\n' ' ')
echo "beat base ($b µs) by > 1 µs: ${best:-none}" >> "$S"
if [ -n "$best" ]; then
  for v in base $best base $best; do t && batch1_rounds $FL $v-$(date +%s) $(variant_env $v); done
  v1=${best%% *}
  if t; then
    env $(variant_env $v1) timeout 150 .devbin/tests/cuda_packed --test-threads 1 \
      cuda_one_row_experts_in_two_launches_are_bitwise > "$OUT/test-packed-$v1.txt" 2>&1
    echo "cuda_packed two-launch test with $v1: exit $?" >> "$S"
  fi
fi
t && run_test cuda_backend
t && batches_16_64 $FL
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cat "$S"
