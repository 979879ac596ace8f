#!/usr/bin/env bash
# Prepared in the forty-fourth session, any GPU, ~4 minutes, on devbin.tar.xz (164e28b's binaries;
# kernel directory shm0 = d1c0e48's built-in kernels). Measures only, no new code:
# - batch 1 on $FL q2 layers, verify 1+1..1+4 and the DSpark rounds, two passes over
#   base (shm0, DSV4_FFN1_ROWS 4), f5 / f8 (DSV4_FFN1_ROWS 5 / 8: verify 1+4's five rows and the
#   draft's five rows on the n-row two launches), t0 (DSV4_X8_TILES=off: 5-row dense products on
#   the dp4a row groups instead of the int8 tiles) and f5t0 (both);
# - one draft's kernels under ncu (4 layers) at base and at f5t0.
#   run(command: "bash tools/device/call_s44a.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 420
K=DSV4_CUDA_KERNELS=.devbin/kvar/shm0
envs() {
  case $1 in
    base) echo $K ;;
    f5) echo $K DSV4_FFN1_ROWS=5 ;;
    f8) echo $K DSV4_FFN1_ROWS=8 ;;
    t0) echo $K DSV4_X8_TILES=off ;;
    f5t0) echo $K DSV4_FFN1_ROWS=5 DSV4_X8_TILES=off ;;
  esac
}
rounds4() {
  local v=$1; shift
  env "$@" timeout 80 .devbin/dsv4 bench --backend cuda --synthetic flash --layers "$FL" --weights q2 --contexts '' \
      --reserve 1x4096 --decode-fill clone --decode-batches 1 --decode-context 4096 --decode-tokens 16 \
      --verify-drafts 1,2,3,4 --dspark-round > "$OUT/ab-$v.txt" 2>&1
  echo "== $v ($*): exit $?" >> "$S"
  grep -E '^(decode batch +1 at|verify|dspark batch +1(: draft|, measured))' "$OUT/ab-$v.txt" \
    | sed -E 's/ = [0-9.]+x a decode.*//; s/ +[0-9.]+ ms\/layer.*//' | cut -c1-200 >> "$S"
}
for pass in 1 2; do
  for v in base f5 f8 t0 f5t0; do
    # shellcheck disable=SC2046
    t && rounds4 $v-$pass $(envs $v)
  done
done
for v in base f5t0; do
  # shellcheck disable=SC2046
  t && { env $(envs $v) bash tools/device/ncu_draft.sh 4 1 > "$OUT/ncu-draft-run-$v.txt" 2>&1;
         mv "$OUT/ncu-draft-1.txt" "$OUT/ncu-draft-$v.txt";
         sed -n '/^one step/,$p' "$OUT/ncu-draft-$v.txt" | head -30 | sed "s/^/$v draft: /" >> "$S"; }
done
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cd "$OUT" && tar -czf all.tgz --exclude all.tgz ./*.txt && find . -name '*.txt' ! -name summary.txt -delete
cut -c1-200 summary.txt
