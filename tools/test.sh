#!/usr/bin/env bash
# The whole test suite (what CI runs): Rust tests (GPU tests skip without a GPU, but the CUDA
# backend is compiled), then the OpenAI/Anthropic SDK tests against a live `dsv4 serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --locked --features dsv4/cuda
# The SDK tests drive the `dsv4` binary that `cargo test` just built (optimised, see Cargo.toml).
cargo build --locked -p dsv4 --features cuda
python3 -m venv target/api-venv
target/api-venv/bin/pip install --quiet --disable-pip-version-check -r tests/api/requirements.txt
DSV4_BIN="$PWD/target/debug/dsv4" target/api-venv/bin/python -m pytest -q tests/api
