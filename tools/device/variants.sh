#!/usr/bin/env bash
# Here, after build.sh: kernel files as of git revisions, or the current ones edited by a sed
# expression, for DSV4_CUDA_KERNELS on the device (a bisect or an A/B without rebuilding;
# launch signatures must match the built binaries').
#   bash tools/device/variants.sh NAME=REV:file.cu[,file.cu...] NAME=sed:file.cu:EXPR \
#       NAME=revert:REV:file.cu NAME=apply:REV:file.cu ...
# e.g. `pre-v9=eb05911:quant.cu` writes .devbin/kvar/pre-v9/quant.cu as of eb05911, and
# `lb=sed:attention.cu:'s/void attention(/void __launch_bounds__(256, 2) attention(/'` the
# current attention.cu with that edit. `revert:REV` is the current file without commit REV's
# change to it, `apply:REV` the current file with it; REV may be a range A..B (a branch:
# `apply:$(git merge-base main B)..B`). A whole file as of an older revision lacks the kernels
# added since, and the module then fails to load.
set -euo pipefail
cd "$(dirname "$0")/../.."
K=crates/dsv4-backend/src/cuda/kernels
for spec in "$@"; do
    name=${spec%%=*} rest=${spec#*=}
    rev=${rest%%:*} files=${rest#*:}
    mkdir -p ".devbin/kvar/$name"
    if [ "$rev" = revert ] || [ "$rev" = apply ]; then
        r=${files%%:*} f=${files#*:}
        flag=; [ "$rev" = revert ] && flag=-R
        range=$r; [[ $r == *..* ]] || range="$r^..$r"
        git diff "$range" -- "$K/$f" | patch -s $flag -o ".devbin/kvar/$name/$f" "$K/$f" \
            || { echo "$name: $range's change to $f does not $rev cleanly" >&2; exit 1; }
        echo "$name: $f, $rev $range"
        continue
    fi
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
