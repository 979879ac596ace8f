#!/usr/bin/env bash
# Thirty-fifth session, call c: the experts table (its calls now timed behind queued GPU work,
# so the kernels run back to back) on the built-in kernels and the one-row expert variants,
# while the call has time (each process ~60 s: NVRTC and the draw).
#   run(command: "bash tools/device/call_s35c.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
E="--backend cuda --synthetic kernels --tables experts"
T0=$(date +%s)
for v in base up4b dn5bp pf512 sel16 dnp; do
  [ $(( $(date +%s) - T0 )) -lt ${BUDGET:-250} ] || break
  case $v in
    base) env=() ;;
    dnp) env=(DSV4_DOWN1_PAIRS=1) ;;
    dn5bp) env=(DSV4_DOWN1_PAIRS=1 DSV4_CUDA_KERNELS=.devbin/kvar/dn5b) ;;
    *) env=(DSV4_CUDA_KERNELS=.devbin/kvar/$v) ;;
  esac
  t0=$(date +%s)
  env "${env[@]}" timeout 100 .devbin/dsv4 bench $E > "$OUT/experts-$v.txt" 2>&1
  echo "== $v: exit $? in $(( $(date +%s) - t0 )) s" >> "$S"
  grep -E '^experts|rror' "$OUT/experts-$v.txt" | cut -c1-200 >> "$S"
done
cat "$S"
