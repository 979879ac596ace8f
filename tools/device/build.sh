#!/usr/bin/env bash
# Builds what one device session runs (no GPU needed here): the release `dsv4` binary and every
# CUDA test binary, stripped, into .devbin/ (ignored by git; carry it with the device tool's
# `carry: [".devbin"]`), with the DSpark fixtures. Then on the device: tools/device/run.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.devbin/' .git/info/exclude 2>/dev/null || echo '/.devbin/' >> .git/info/exclude
# The tree and .devbin together exceed the 64 MiB a device call carries: pack it after this
# script (`rm -rf .devbin/wheels; tar -cJf devbin.tar.xz .devbin`, ~8 MB) and carry the tarball.
grep -qx '/devbin.tar.xz' .git/info/exclude 2>/dev/null || echo '/devbin.tar.xz' >> .git/info/exclude
rm -rf .devbin && mkdir -p .devbin/tests
cargo build --release --locked -p dsv4 --features cuda
cp target/release/dsv4 .devbin/dsv4
# Test executables of the crates with CUDA tests, from cargo's own list.
cargo test --release --locked --features dsv4/cuda -p dsv4-backend -p dsv4-engine -p dsv4 --no-run \
    --message-format=json \
  | python3 -c '
import json, sys, shutil, os
for line in sys.stdin:
    m = json.loads(line)
    exe = m.get("executable")
    name = m.get("target", {}).get("name", "")
    if exe and m.get("profile", {}).get("test") and (name.startswith("cuda") or name == "nonfinite"):
        shutil.copy(exe, os.path.join(".devbin/tests", name))
        print("test binary:", name)
'
strip .devbin/dsv4 .devbin/tests/*
# The pinned transformers wheel for run.sh's `hf` part (the device has no network).
python3 -m pip download -q --no-deps -d .devbin/wheels transformers==5.23.0 || echo "no transformers wheel: run.sh hf will use the device's own"
# (the DSpark fixtures travel with the tree: crates/dsv4-dspark/tests/fixtures)
du -sh .devbin
