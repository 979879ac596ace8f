#!/usr/bin/env bash
# Twenty-ninth session, draw.cu variants (calls c and d of BENCHMARKS.md's "Sampling on the
# device"): call_s29b.sh without cuda_dspark, greedy then sampled decode.
DSPARK=0 MODES="greedy sample" exec bash "$(dirname "$0")/call_s29b.sh"
