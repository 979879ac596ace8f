#!/usr/bin/env bash
# Ran in the thirty-ninth session (PERF.md v48), any GPU, ~7 minutes. Its pff* kernel
# directories were b43e83f's quant.cu; X8_PF_FRONT is gone since
# (tools/device/patches/v48-pf-front.diff). The experts table
# now runs the step's int8 kernels (moe_up1s / moe_down1s; to 1245b79 it ran the f32 ones, so
# v44–v47's experts figures and variant rows timed kernels the step does not run). In order: the
# pffs form checked bitwise, the experts table of the built-in kernels with the new one-row
# attention products (onerow), the experts table for pffs / pff132p, batch 1 alternating the
# built-in kernels and the variant with the lowest one-row DRAM figure, then the tests
# (cuda_gguf's side masks 1–3 first), batches 16 / 64 and the device's CUDA tools.
#   run(command: "bash tools/device/call_s39a.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 420
export DSV4_BIN=.devbin/dsv4
DSV4_CUDA_KERNELS=.devbin/kvar/pffs run_test cuda_packed cuda_one_row_experts_in_two_launches_are_bitwise
cp "$OUT/test-cuda_packed.txt" "$OUT/test-cuda_packed-pff.txt"
TABLES=experts,onerow experts_table base
t && BUDGET=$LIMIT experts_variants $T0 pffs pff132p
best=$(for v in base pffs pff132p; do
  f=$(grep -E '^experts 1 rows, dram' "$OUT/experts-$v.txt" 2>/dev/null | grep -m1 -oE '[0-9.]+ µs a call' | cut -d' ' -f1)
  [ -n "$f" ] && echo "$f $v"; done | sort -n | head -1 | cut -d' ' -f2)
best=${best:-pffs}; [ "$best" = base ] && best=pffs; echo "best: $best" >> "$S"
for v in base $best base $best; do
  if [ $v = base ]; then t && batch1_rounds $FL base-$(date +%s)
  else t && batch1_rounds $FL $v-$(date +%s) DSV4_CUDA_KERNELS=.devbin/kvar/$v; fi
done
t && run_test cuda_gguf
t && TABLES=onerow experts_table opw2 DSV4_X8_OPW=2,1,1
for x in cuda_packed cuda_graph cuda_dspark cuda_invariance cuda_backend; do
  t && run_test $x
done
t && batches_16_64 $FL
{ echo "tools: $(ls /usr/local/cuda/bin | tr '\n' ' ')"; echo "nsys: $(command -v nsys; ls -d /opt/nvidia/nsight-systems* /usr/local/cuda/nsight-systems* 2>/dev/null)"; } >> "$S"
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cat "$S"
