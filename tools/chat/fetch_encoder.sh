#!/usr/bin/env bash
# Download DeepSeek's V4 reference chat encoder (encoding_dsv4.py) from the
# sglang wheel on PyPI and check it against a known sha256.
#
# Usage: tools/chat/fetch_encoder.sh DEST_DIR
#   Leaves DEST_DIR/encoding_dsv4.py; then run tools/chat/gen_expected.py on it.
#   Needs: python3 with pip, unzip, sha256sum.
set -euo pipefail

VERSION=0.5.22
MEMBER=sglang/srt/entrypoints/openai/encoding_dsv4.py
ENCODER_SHA256=4c2b93ebdb9f14b4c2fe9820368b1a91e15d610d548e25392d94c88e5eafe251

DEST=${1:?usage: $0 DEST_DIR}
mkdir -p "$DEST"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# The wheel is per Python version, but the encoder file is the same in all.
python3 -m pip download --quiet --no-deps --only-binary=:all: "sglang==${VERSION}" -d "$TMP"
unzip -q -o "$TMP"/sglang-"${VERSION}"-*.whl "$MEMBER" -d "$TMP/x"
cp "$TMP/x/$MEMBER" "$DEST/encoding_dsv4.py"
echo "${ENCODER_SHA256}  $DEST/encoding_dsv4.py" | sha256sum -c -
