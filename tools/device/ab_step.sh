#!/usr/bin/env bash
# One decode step's time (and the recorded step's kernels a layer) on the built-in kernels and
# on each variant, each run twice in alternation (noise shows as the spread of a pair):
#   run(command: "bash tools/device/ab_step.sh .devbin/kvar/lb DSV4_X8_OPW=1,1,1 ...", carry: [".devbin"])
# A variant is a kernel directory (DSV4_CUDA_KERNELS, see variants.sh) or VAR=VALUE (environment
# for that run only; several joined by '+': A=1+B=2). LAYERS (4), WEIGHTS (q2), CTX (4096) and
# BATCH (1) pick the bench; EXTRA adds bench arguments (e.g. "--reserve 64x4096 --decode-fill
# clone": batch 64 from one prefilled sequence); other environment passes through to every run.
set -uo pipefail
cd "$(dirname "$0")/../.."
L=${LAYERS:-4} W=${WEIGHTS:-q2} C=${CTX:-4096} B=${BATCH:-1}
for pass in 1 2; do
    for v in builtin "$@"; do
        envs=()
        case "$v" in
            builtin) ;;
            *=*) IFS='+' read -ra envs <<< "$v" ;;
            *) envs=("DSV4_CUDA_KERNELS=$PWD/$v") ;;
        esac
        out=$(env "${envs[@]}" timeout 120 .devbin/dsv4 bench --backend cuda --synthetic flash --layers "$L" --weights "$W" \
            --contexts '' --decode-batches "$B" --decode-context "$C" --decode-tokens 64 ${EXTRA:-} 2>&1)
        r=$(grep -E '^decode batch .* ms/step' <<< "$out" | head -1 | cut -c1-110)
        k=$(grep -oE 'kernels = [0-9.]+ a layer' <<< "$out" | head -1)
        echo "pass $pass  $(basename "$v")  ${r:-no result}  ${k:+($k)}"
    done
done
