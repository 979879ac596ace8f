#!/usr/bin/env bash
# Prepared in the thirty-eighth session (PERF.md v47), any GPU, ~7 minutes, on b43e83f's binaries
# or later (route_shared and DSV4_SIDE bit 4 removed): X8_PF_FRONT (kvar/pffN: the current
# quant.cu with N issuing blocks; pffNp: moe_down1s's share before its PDL wait) checked bitwise,
# the experts table for pff0 / pff132 / pff132p, batch 1 alternating the built-in kernels and the
# variant with the lowest one-row DRAM figure, then the tests the removals touch (cuda_gguf's side
# branch masks 1–3, cuda_packed) and the other CUDA tests while the call has time.
#   run(command: "bash tools/device/call_s38c.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 420
export DSV4_BIN=.devbin/dsv4
DSV4_CUDA_KERNELS=.devbin/kvar/pffs run_test cuda_packed cuda_one_row_experts_in_two_launches_are_bitwise
cp "$OUT/test-cuda_packed.txt" "$OUT/test-cuda_packed-pff.txt"
BUDGET=$LIMIT experts_variants $T0 pff0 pffs
best=$(for v in pffs pff132p; do
  f=$(grep -E '^experts 1 rows, dram' "$OUT/experts-$v.txt" 2>/dev/null | grep -m1 -oE '[0-9.]+ µs a call' | cut -d' ' -f1)
  [ -n "$f" ] && echo "$f $v"; done | sort -n | head -1 | cut -d' ' -f2)
best=${best:-pffs}; echo "best: $best" >> "$S"
for v in base $best base $best; do
  if [ $v = base ]; then t && batch1_rounds $FL base-$(date +%s)
  else t && batch1_rounds $FL $v-$(date +%s) DSV4_CUDA_KERNELS=.devbin/kvar/$v; fi
done
t && run_test cuda_gguf
t && BUDGET=$LIMIT experts_variants $T0 pff132p
for x in cuda_packed cuda_graph cuda_dspark cuda_invariance cuda_backend; do
  t && run_test $x
done
t && DSV4_CUDA_KERNELS=.devbin/kvar/$best batches_16_64 $FL
{ echo "tools: $(ls /usr/local/cuda/bin | tr '\n' ' ')"; echo "nsys: $(command -v nsys; ls -d /opt/nvidia/nsight-systems* /usr/local/cuda/nsight-systems* 2>/dev/null)"; } >> "$S"
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cat "$S"
