#!/usr/bin/env bash
# Prepared in the thirty-fourth session, after call_s34b.sh on the same binaries: where the
# experts' two launches stop winning against the several-row path. DSV4_FFN1_ROWS 4 (built in),
# 5 and 8 at batch 1's verify 1+4 (5 rows) and the DSpark draft (5 rows a block), 43 q2 layers
# (32 on an H100); then 4 layers at batches 5 and 8, each setting.
#   run(command: "bash tools/device/call_s34d.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G" >> "$S"
FL=43; case "$G" in *H100*) FL=32 ;; esac
for r in 4 5 8; do
  DSV4_FFN1_ROWS=$r timeout 120 .devbin/dsv4 bench --backend cuda --synthetic flash --layers $FL --weights q2 --contexts '' \
      --reserve 1x4096 --decode-fill clone --decode-batches 1 --decode-context 4096 --decode-tokens 16 \
      --verify-drafts 3,4 --dspark-round > "$OUT/ffn1-$r.txt" 2>&1
  echo "== flash q2 $FL layers, DSV4_FFN1_ROWS=$r: exit $?" >> "$S"
  grep -E '^(decode batch|verify|dspark batch +[0-9]+(: draft|, measured))' "$OUT/ffn1-$r.txt" | cut -c1-200 >> "$S"
done
for r in 4 5 8; do
  DSV4_FFN1_ROWS=$r timeout 60 .devbin/dsv4 bench --backend cuda --synthetic flash --layers 4 --weights q2 --contexts '' \
      --reserve 8x4096 --decode-fill clone --decode-batches 5,8 --decode-context 4096 --decode-tokens 16 \
      > "$OUT/ffn1-4l-$r.txt" 2>&1
  echo "== 4 layers, DSV4_FFN1_ROWS=$r: exit $?" >> "$S"
  grep -E '^decode batch' "$OUT/ffn1-4l-$r.txt" | cut -c1-160 >> "$S"
done
cat "$S"
