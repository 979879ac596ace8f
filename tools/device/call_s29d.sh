#!/usr/bin/env bash
# Twenty-ninth session, draw.cu variants (calls e and f of BENCHMARKS.md's "Sampling on the
# device"): call_s29b.sh without cuda_dspark, sampled then greedy decode.
DSPARK=0 MODES="sample greedy" exec bash "$(dirname "$0")/call_s29b.sh"
