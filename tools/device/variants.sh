#!/usr/bin/env bash
# Here, after build.sh: kernel files as of git revisions, or the current ones edited by a sed
# expression, for DSV4_CUDA_KERNELS on the device (a bisect or an A/B without rebuilding;
# launch signatures must match the built binaries').
#   bash tools/device/variants.sh NAME=REV:file.cu[,file.cu...] NAME=sed:file.cu:EXPR ...
# e.g. `pre-v9=eb05911:quant.cu` writes .devbin/kvar/pre-v9/quant.cu as of eb05911, and
# `lb=sed:attention.cu:'s/void attention(/void __launch_bounds__(256, 2) attention(/'` the
# current attention.cu with that edit.
set -euo pipefail
cd "$(dirname "$0")/../.."
K=crates/dsv4-backend/src/cuda/kernels
for spec in "$@"; do
    name=${spec%%=*} rest=${spec#*=}
    rev=${rest%%:*} files=${rest#*:}
    mkdir -p ".devbin/kvar/$name"
    if [ "$rev" = sed ]; then
        f=${files%%:*} expr=${files#*:}
        sed -e "$expr" "$K/$f" > ".devbin/kvar/$name/$f"
        if cmp -s "$K/$f" ".devbin/kvar/$name/$f"; then echo "$name: the expression changed nothing in $f" >&2; exit 1; fi
        echo "$name: $f with $expr"
        continue
    fi
    for f in ${files//,/ }; do
        git show "$rev:$K/$f" > ".devbin/kvar/$name/$f"
    done
    echo "$name: $files as of $(git rev-parse --short "$rev")"
done
