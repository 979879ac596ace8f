#!/usr/bin/env python3
"""Writes the GGUF fixtures under tests/fixtures/gguf/ (CI never runs this).

    python3 -m venv /tmp/ggufenv && /tmp/ggufenv/bin/pip install -r tools/gguf/requirements.txt
    /tmp/ggufenv/bin/python tools/gguf/gen_fixtures.py

The `gguf` package (llama.cpp's gguf-py) is the oracle: `gguf.quants.quantize` makes the Q8_0 and
BF16 bytes, `gguf.quants.dequantize` every expected f32, `gguf.GGUFWriter` the files and
`gguf.GGUFReader` the manifest of tensor infos. The package implements dequantisation of Q4_K,
Q2_K and IQ2_XXS but not their quantisation, so those tensors hold random blocks with finite f16
scales (every bit pattern of the other fields is a valid block).

Outputs:
- blocks.gguf: one tensor per type (`<type>`), its expected dequantisation (`<type>.expected`,
  F32, same shape), the Q8_0 quantiser's input (`q8_0.src`) and an input for the Rust K-quant
  quantisers (`kquant.src`); `general.alignment` = 64.
- meta.gguf: every metadata value type (nested arrays too), default alignment, small tensors.
- manifest.json: tensor infos of both files as GGUFReader reads them (GGUF dim order).
"""

import importlib.metadata
import json
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf.quants import dequantize, quantize

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "gguf")
rng = np.random.default_rng(20260514)


def f16_scales(n):
    """Finite f16 scales: mostly small normals, plus zero, a subnormal, negatives and a large one."""
    d = (rng.normal(size=n) * 0.01).astype(np.float16)
    d[0] = 0.0
    d[1] = np.float16(3e-6)  # subnormal
    d[2] = np.float16(-0.5)
    d[3] = np.float16(1000.0)
    assert np.isfinite(d).all()
    return d.view(np.uint8).reshape(n, 2)


def random_blocks(qtype, n):
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n, type_size), dtype=np.uint8)
    if qtype == T.Q4_K:  # d, dmin at 0..4
        b[:, 0:2] = f16_scales(n)
        b[:, 2:4] = f16_scales(n)
    elif qtype == T.Q2_K:  # d, dmin at 80..84
        b[:, 80:82] = f16_scales(n)
        b[:, 82:84] = f16_scales(n)
    elif qtype == T.IQ2_XXS:  # d at 0..2
        b[:, 0:2] = f16_scales(n)
    return b


def q8_0_input():
    """(3, 5, 640): 300 blocks of varied scale, with edge blocks (zeros, one spike, exact halves)."""
    x = rng.normal(size=(3, 5, 640)).astype(np.float32)
    x *= np.exp(rng.normal(size=(3, 5, 20, 1)) * 2).repeat(32, axis=3).reshape(3, 5, 640).astype(np.float32)
    flat = x.reshape(-1, 32)
    flat[0] = 0.0
    flat[1] = 0.0
    flat[1, 7] = -3.25
    flat[2] = np.array([127, 63.5, -63.5, 0.5, -0.5, 2.5, -2.5, 126.5] * 4, dtype=np.float32)
    flat[3] = np.float32(1e-30)
    return x


def kquant_input():
    """(4, 1024): 16 K-quant blocks: gaussian, shifted, all-positive, constant, zero, one spike."""
    x = rng.normal(size=(4, 1024)).astype(np.float32)
    blocks = x.reshape(-1, 256)
    blocks[1] += 3.0
    blocks[2] = np.abs(blocks[2])
    blocks[3] = 0.7
    blocks[4] = 0.0
    blocks[5] = 0.0
    blocks[5, 100] = -5.0
    blocks[6] *= 1e-3
    blocks[7] *= 100.0
    blocks[8, :128] = 0.0  # half the sub-blocks empty
    return x


def write_blocks(path):
    w = gguf.GGUFWriter(path, arch="dsv4-test")
    w.add_custom_alignment(64)

    def add(name, arr, raw_dtype=None):
        w.add_tensor(name, arr, raw_dtype=raw_dtype)

    f32 = (np.arange(256, dtype=np.float32) * 0.25 - 30.0).reshape(4, 64)
    add("f32", f32)
    f16 = rng.normal(size=(4, 64)).astype(np.float16)
    add("f16", f16)
    add("f16.expected", dequantize(f16, T.F16))
    bf = quantize((rng.normal(size=(4, 64)) * 10).astype(np.float32), T.BF16)
    add("bf16", bf, T.BF16)
    add("bf16.expected", dequantize(bf, T.BF16))
    add("i32", rng.integers(-1000, 1000, size=(6, 8), dtype=np.int32))

    src = q8_0_input()
    q8 = quantize(src, T.Q8_0)
    add("q8_0.src", src)
    add("q8_0", q8, T.Q8_0)
    add("q8_0.expected", dequantize(q8, T.Q8_0))

    for name, qt in [("q4_k", T.Q4_K), ("q2_k", T.Q2_K), ("iq2_xxs", T.IQ2_XXS)]:
        rows, per_row = 16, 16  # 256 blocks of 256 values
        blocks = random_blocks(qt, rows * per_row).reshape(rows, -1)
        exp = dequantize(blocks, qt)
        assert exp.shape == (rows, per_row * 256) and np.isfinite(exp).all()
        add(name, blocks, qt)
        add(name + ".expected", exp)

    add("kquant.src", kquant_input())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_meta(path):
    w = gguf.GGUFWriter(path, arch="dsv4-test")
    kv = w.add_key_value
    kv("t.u8", 200, V.UINT8)
    kv("t.i8", -100, V.INT8)
    kv("t.u16", 60000, V.UINT16)
    kv("t.i16", -30000, V.INT16)
    kv("t.u32", 4000000000, V.UINT32)
    kv("t.i32", -2000000000, V.INT32)
    kv("t.f32", 0.1, V.FLOAT32)
    kv("t.bool", True, V.BOOL)
    kv("t.string", "héllo, GGUF", V.STRING)
    kv("t.u64", 2**63 + 5, V.UINT64)
    kv("t.i64", -(2**62) - 7, V.INT64)
    kv("t.f64", 0.1, V.FLOAT64)
    kv("t.arr_i32", [1, -2, 3], V.ARRAY)
    kv("t.arr_u16", [1, 2, 65535], V.ARRAY, sub_type=V.UINT16)
    kv("t.arr_str", ["a", "", "ünï"], V.ARRAY)
    kv("t.arr_f32", [0.5, -1.5], V.ARRAY)
    kv("t.arr_bool", [False, True], V.ARRAY)
    kv("t.arr_nested", [[1, 2], [3]], V.ARRAY)
    w.add_tensor("vec", np.arange(5, dtype=np.float32))
    w.add_tensor("blk.0.w", np.arange(24, dtype=np.float16).reshape(2, 3, 4))
    w.add_tensor("idx", np.arange(12, dtype=np.int32).reshape(4, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def manifest(path):
    r = gguf.GGUFReader(path)
    return {
        "alignment": int(r.alignment),
        "data_offset": int(r.data_offset),
        "tensors": [
            {
                "name": t.name,
                "type": int(t.tensor_type),
                "dims": [int(d) for d in t.shape],
                "offset": int(t.data_offset) - int(r.data_offset),
                "n_bytes": int(t.n_bytes),
            }
            for t in r.tensors
        ],
    }


def main():
    os.makedirs(OUT, exist_ok=True)
    files = {}
    for name, fn in [("blocks.gguf", write_blocks), ("meta.gguf", write_meta)]:
        p = os.path.join(OUT, name)
        fn(p)
        files[name] = manifest(p)
    files["gguf_version"] = importlib.metadata.version("gguf")
    with open(os.path.join(OUT, "manifest.json"), "w") as f:
        json.dump(files, f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(OUT, n)) for n in os.listdir(OUT))
    print(f"wrote {OUT} ({total} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
