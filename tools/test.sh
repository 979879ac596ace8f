#!/usr/bin/env bash
# The whole test suite (what CI runs after `cargo fmt --check` and clippy, `.ci/run`): Rust tests (GPU tests skip without a GPU, but the CUDA
# backend is compiled), then the OpenAI/Anthropic SDK tests against a live `dsv4 serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --locked --features dsv4/cuda
# The SDK tests drive the `dsv4` binary that `cargo test` just built (optimised, see Cargo.toml).
cargo build --locked -p dsv4 --features cuda
python3 -m venv target/api-venv
target/api-venv/bin/pip install --quiet --disable-pip-version-check -r tests/api/requirements.txt
# The coding agents the API tests drive (pinned; cached under target/ between runs).
CLIENTS="@anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0"
if [ "$(cat target/agent-clients/.pinned 2>/dev/null)" != "$CLIENTS" ]; then
  rm -rf target/agent-clients && mkdir -p target/agent-clients
  npm install --silent --no-audit --no-fund --prefix target/agent-clients $CLIENTS
  echo "$CLIENTS" > target/agent-clients/.pinned
fi
DSV4_BIN="$PWD/target/debug/dsv4" target/api-venv/bin/python -m pytest -q tests/api
