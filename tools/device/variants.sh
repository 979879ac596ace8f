#!/usr/bin/env bash
# Here, after build.sh: kernel files as of git revisions, for DSV4_CUDA_KERNELS on the device
# (a bisect or an A/B without rebuilding; launch signatures must match the built binaries').
#   bash tools/device/variants.sh NAME=REV:file.cu[,file.cu...] ...
# e.g. `pre-v9=eb05911:quant.cu` writes .devbin/kvar/pre-v9/quant.cu as of eb05911.
set -euo pipefail
cd "$(dirname "$0")/../.."
for spec in "$@"; do
    name=${spec%%=*} rest=${spec#*=}
    rev=${rest%%:*} files=${rest#*:}
    mkdir -p ".devbin/kvar/$name"
    for f in ${files//,/ }; do
        git show "$rev:crates/dsv4-backend/src/cuda/kernels/$f" > ".devbin/kvar/$name/$f"
    done
    echo "$name: $files as of $(git rev-parse --short "$rev")"
done
