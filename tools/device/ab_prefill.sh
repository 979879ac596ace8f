#!/usr/bin/env bash
# Issue 12's prefill on the built-in kernels and on each variant: the 8K stage profile of 4 q2
# layers (the GPU timeline and its three largest stages), then 43 q2 layers and 16 official
# layers at 8K (two chunks each, tok/s extrapolated to 43 layers), one table row per variant:
#   run(command: "bash tools/device/ab_prefill.sh .devbin/kvar/ahead DSV4_ROPE_CAST=0 ...", carry: [".devbin"])
# A variant is a kernel directory (DSV4_CUDA_KERNELS, see variants.sh; its first run pays the
# NVRTC compile of the files it replaces, ~50 s for quant.cu or gemm.cu) or VAR=VALUE (several
# joined by '+'). FULL=0 skips the 43- and 16-layer runs. Writes $OUT/ab-prefill.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/dsv4-out}
mkdir -p "$OUT"
A=$OUT/ab-prefill.txt
P="bench --backend cuda --synthetic flash --prefill-chunk 8192 --decode-batches 1 --decode-context 16 --decode-tokens 1"
printf '%-22s %-26s %-40s %-22s %s\n' variant "4 q2 layers, GPU ms" "largest stages (ms)" "43 q2 layers, tok/s" "official, tok/s" >> "$A"
for v in builtin "$@"; do
    envs=()
    case "$v" in
        builtin) ;;
        *=*) IFS='+' read -ra envs <<< "$v" ;;
        *) envs=("DSV4_CUDA_KERNELS=$PWD/$v") ;;
    esac
    env "${envs[@]}" DSV4_PROFILE_PREFILL=8192 timeout 150 .devbin/dsv4 $P --layers 4 --weights q2 --contexts '' \
        > /tmp/ab-prof.txt 2>&1
    gpu=$(grep -oE '[0-9.]+ ms GPU timeline' /tmp/ab-prof.txt | head -1 | cut -d' ' -f1)
    top=$(grep -E '^  [a-z]' /tmp/ab-prof.txt | head -3 | awk '{printf "%s %s  ", $1, $4}')
    q2=- off=-
    if [ "${FULL:-1}" != 0 ]; then
        q2=$(env "${envs[@]}" timeout 150 .devbin/dsv4 $P --layers 43 --weights q2 --contexts 8192,8192 2>&1 \
            | grep -E '^prefill' | grep -oE '[0-9]+ tok/s with' | cut -d' ' -f1 | paste -sd/)
        off=$(env "${envs[@]}" timeout 150 .devbin/dsv4 $P --layers 16 --weights official --contexts 8192,8192 2>&1 \
            | grep -E '^prefill' | grep -oE '[0-9]+ tok/s extrap' | cut -d' ' -f1 | paste -sd/)
    fi
    printf '%-22s %-26s %-40s %-22s %s\n' "$(basename "$v")" "${gpu:-no result}" "$top" "${q2:-no result}" "${off:-no result}" >> "$A"
    grep -iE 'panicked|error' /tmp/ab-prof.txt | head -3 >> "$A"
done
cat "$A"
