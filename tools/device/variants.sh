#!/usr/bin/env bash
# Here, after build.sh: kernel files as of git revisions, or the current ones edited by a sed
# expression, for DSV4_CUDA_KERNELS on the device (a bisect or an A/B without rebuilding;
# launch signatures must match the built binaries').
#   bash tools/device/variants.sh NAME=REV:file.cu[,file.cu...] NAME=sed:file.cu:EXPR \
#       NAME=revert:REV:file.cu NAME=apply:REV:file.cu NAME=patch:FILE.diff ...
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
    if [ "$rev" = patch ]; then
        # The kernel files a patch (git diff form, e.g. tools/device/patches/*.diff) touches, with
        # it applied to the current ones.
        pf=$files tmp=$(mktemp -d)
        awk -v k="$K/" '/^diff --git /{keep = index($3, "a/" k) == 1} keep' "$pf" > "$tmp/k.diff"
        for f in $(grep -oE "^\+\+\+ b/$K/[^ ]+" "$tmp/k.diff" | sed "s|^+++ b/$K/||"); do
            mkdir -p "$tmp/a/$K" && cp "$K/$f" "$tmp/a/$K/$f"
        done
        (cd "$tmp/a" && patch -s -p1 < "$tmp/k.diff") || { echo "$name: $pf does not apply" >&2; exit 1; }
        for f in $(ls "$tmp/a/$K"); do cp "$tmp/a/$K/$f" ".devbin/kvar/$name/$f"; done
        rm -rf "$tmp"
        echo "$name: $(ls .devbin/kvar/$name | tr '\n' ' ')with $pf"
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
