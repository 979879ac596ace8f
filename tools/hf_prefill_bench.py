#!/usr/bin/env python3
"""HF transformers' own prefill of DeepSeek V4-Flash-dimension layers on one GPU: the side-by-side
figure of issue 12, against `dsv4 bench --backend cuda --synthetic flash --layers 4 --weights bf16
--contexts 1024,4096 --prefill-chunk 8192` in the same device call.

The layers are dsv4's `flash_layers(4)` (crates/dsv4/src/flash_bench.rs): SWA and CSA on hash
routing, then HCA and CSA on the learned router; every dimension is V4-Flash's (hidden 4096, 64
heads of 512, 256 experts of 2048, top 6, indexer 64 x 128 top 512, window 128, mHC 4). Weights
are HF's own initialisation in bf16 (their values do not change the work); the prompt is random
token ids. Timed with CUDA events: the median of --reps forward passes of the whole prompt
(HF's prefill: `model(input_ids)`), after one warm-up pass.

Pinned: transformers 5.23.0 (tools/requirements.txt). The device image has 5.17 and no network,
so carry the wheel:
  here:   pip download --no-deps -d .devbin/wheels transformers==5.23.0
  there:  pip install --no-deps --target /tmp/hf523 .devbin/wheels/transformers-5.23.0-py3-none-any.whl
          PYTHONPATH=/tmp/hf523 python3 tools/hf_prefill_bench.py --lengths 1024,4096
Prints one line a length and a JSON summary last.
"""
import argparse
import json

import torch
import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def flash_config(layers):
    """V4-Flash's dimensions with dsv4's `flash_layers(n)` schedule (n <= 4 here)."""
    kinds = [SWA, CSA, HCA, CSA][:layers]
    mlp = ["hash_moe", "hash_moe", "moe", "moe"][:layers]
    cfg = DeepseekV4Config(
        vocab_size=129280, hidden_size=4096, num_hidden_layers=layers, num_attention_heads=64, head_dim=512,
        q_lora_rank=1024, partial_rotary_factor=64 / 512, num_experts_per_tok=6, n_routed_experts=256,
        n_shared_experts=1, moe_intermediate_size=2048, layer_types=kinds, mlp_layer_types=mlp,
        compress_rates={CSA: 4, HCA: 128}, sliding_window=128, o_groups=8, o_lora_rank=1024,
        index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        swiglu_limit=10.0, routed_scaling_factor=1.5, rms_norm_eps=1e-6, max_position_embeddings=1 << 20,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
    )
    return cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    assert 1 <= a.layers <= 4, "--layers: 1 to 4 (dsv4's flash_layers(4) schedule)"
    if transformers.__version__ != "5.23.0":
        print(f"warning: transformers {transformers.__version__}, not the pinned 5.23.0")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    with torch.device(dev):
        model = DeepseekV4ForCausalLM(flash_config(a.layers)).to(torch.bfloat16).eval()
    results = []
    for n in [int(x) for x in a.lengths.split(",") if x]:
        ids = torch.randint(0, 129280, (1, n), device=dev)
        times = []
        with torch.inference_mode():
            model(ids, use_cache=False)  # warm-up (kernel selection, allocator)
            for _ in range(a.reps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                model(ids, use_cache=False)
                e1.record()
                torch.cuda.synchronize()
                times.append(e0.elapsed_time(e1) / 1e3)
        t = sorted(times)[len(times) // 2]
        print(f"hf prefill {n:>6} tokens, {a.layers} layers: {t:8.3f} s  {n / t:10.0f} tok/s")
        results.append({"tokens": n, "secs": t, "tokens_per_s": n / t})
    print(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                      "device": torch.cuda.get_device_name(), "layers": a.layers, "results": results}))


if __name__ == "__main__":
    main()
