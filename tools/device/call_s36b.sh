#!/usr/bin/env bash
# Prepared in the thirty-fifth session (PERF.md v44): the session's kernel changes against the
# kernels of 01ba452 (kvar/s34: quant.cu, hc.cu and attention.cu) at batch 1 on 43 layers (an
# H200; 32 on an H100), decode and the DSpark rounds, then cuda_invariance and batches 16 / 64.
#   run(command: "bash tools/device/call_s36b.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G" >> "$S"
FL=43; case "$G" in *H100*) FL=32 ;; esac
for v in builtin s34; do
  env=(); [ $v = s34 ] && env=(DSV4_CUDA_KERNELS=.devbin/kvar/s34)
  env "${env[@]}" timeout 80 .devbin/dsv4 bench --backend cuda --synthetic flash --layers $FL --weights q2 --contexts '' \
      --reserve 1x4096 --decode-fill clone --decode-batches 1 --decode-context 4096 --decode-tokens 16 \
      --verify-drafts 1,2,3 --dspark-round > "$OUT/ab-$v.txt" 2>&1
  echo "== $FL layers, $v: exit $?" >> "$S"
  grep -E '^(decode batch +1 at|verify|dspark batch +1(: draft|, measured))' "$OUT/ab-$v.txt" \
    | sed -E 's/ = [0-9.]+x a decode.*//; s/ +[0-9.]+ ms\/layer.*//' | cut -c1-170 >> "$S"
done
run_test cuda_invariance
timeout 100 .devbin/dsv4 bench --backend cuda --synthetic flash --layers $FL --weights q2 --contexts '' \
    --reserve 64x4096 --decode-fill clone --decode-batches 16,64 --decode-context 4096 --decode-tokens 16 \
    > "$OUT/b1664.txt" 2>&1
echo "== $FL layers, batches 16 and 64: exit $?" >> "$S"
grep -E '^decode batch' "$OUT/b1664.txt" | cut -c1-150 >> "$S"
cat "$S"
