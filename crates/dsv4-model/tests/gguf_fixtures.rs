//! The GGUF reader and the ggml block formats against fixtures written by the `gguf` Python
//! package 0.19.0 (`tools/gguf/gen_fixtures.py`): dequantisation must be bitwise equal to
//! `gguf.quants.dequantize`, Q8_0 quantisation bitwise equal to `gguf.quants.quantize`.

use dsv4_model::gguf::{GgmlType, GgufError, GgufFile, GgufValue};
use dsv4_model::quant;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf").join(name)
}

fn blocks() -> GgufFile {
    GgufFile::open(&fixture("blocks.gguf")).expect("blocks.gguf")
}

/// Bitwise equality of two f32 slices (so -0.0 ≠ 0.0 and NaN patterns count), with the first
/// mismatch in the message.
fn assert_bitwise(name: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{name}: element {i}: got {} want {}", got[i], want[i]);
    }
}

#[test]
fn dequantisation_is_bitwise_equal_to_the_gguf_package() {
    let f = blocks();
    for name in ["f16", "bf16", "q8_0", "q4_k", "q2_k", "iq2_xxs"] {
        let t = f.info(name).unwrap();
        let e = f.info(&format!("{name}.expected")).unwrap();
        assert_eq!(t.shape, e.shape, "{name}");
        let got = f.f32(name).unwrap();
        let want = f.f32(&format!("{name}.expected")).unwrap();
        assert_bitwise(name, &got, &want);
    }
    let types: Vec<_> = ["q8_0", "q4_k", "q2_k", "iq2_xxs"].iter().map(|n| f.info(n).unwrap().dtype).collect();
    assert_eq!(types, [GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q2_K, GgmlType::IQ2_XXS]);
    // 256 blocks of each K/i-quant type, 300 of Q8_0.
    assert_eq!(f.info("q4_k").unwrap().numel(), 256 * 256);
    assert_eq!(f.info("q8_0").unwrap().numel(), 300 * 32);
}

#[test]
fn plain_types_read_as_written() {
    let f = blocks();
    let want: Vec<f32> = (0..256).map(|i| i as f32 * 0.25 - 30.0).collect();
    assert_eq!(f.f32("f32").unwrap(), want);
    assert_eq!(f.info("f32").unwrap().shape, [4, 64]);
    let i = f.i32("i32").unwrap();
    assert_eq!(i.len(), 48);
    assert_eq!(f.f32("i32").unwrap(), i.iter().map(|&v| v as f32).collect::<Vec<_>>());
    assert!(f.i32("f32").is_err());
}

#[test]
fn partial_rows_equal_the_whole() {
    let f = blocks();
    for name in ["q8_0", "q4_k", "q2_k", "iq2_xxs", "f16"] {
        let t = f.info(name).unwrap().clone();
        let all = f.f32(name).unwrap();
        let cols = t.cols();
        for (r0, n) in [(0, 1), (1, 3), (t.rows() - 2, 2), (0, t.rows())] {
            let part = f.f32_rows(name, r0, n).unwrap();
            assert_bitwise(name, &part, &all[r0 * cols..(r0 + n) * cols]);
        }
        let err = f.f32_rows(name, t.rows() - 1, 2).unwrap_err().to_string();
        assert!(err.contains(name) && err.contains("beyond"), "{err}");
    }
    // A 3-d tensor, like ds4's stacked experts: GGUF dims [640, 5, 3] → shape [3, 5, 640]; the
    // second "expert" is rows 5..10.
    let t = f.info("q8_0").unwrap();
    assert_eq!(t.dims, [640, 5, 3]);
    assert_eq!(t.shape, [3, 5, 640]);
    assert_eq!((t.rows(), t.cols(), t.row_bytes()), (15, 640, 20 * 34));
    let e1 = f.f32_rows("q8_0", 5, 5).unwrap();
    assert_bitwise("expert 1", &e1, &f.f32("q8_0.expected").unwrap()[5 * 640..10 * 640]);
}

#[test]
fn tensor_infos_match_the_gguf_reader() {
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("manifest.json")).unwrap()).unwrap();
    for file in ["blocks.gguf", "meta.gguf"] {
        let f = GgufFile::open(&fixture(file)).unwrap();
        let mf = &m[file];
        assert_eq!(f.alignment(), mf["alignment"].as_u64().unwrap(), "{file}");
        assert_eq!(f.data_start() as u64, mf["data_offset"].as_u64().unwrap(), "{file}");
        let want = mf["tensors"].as_array().unwrap();
        assert_eq!(f.tensors().len(), want.len(), "{file}");
        for (t, w) in f.tensors().iter().zip(want) {
            assert_eq!(t.name, w["name"].as_str().unwrap());
            assert_eq!(t.dtype.id() as u64, w["type"].as_u64().unwrap(), "{}", t.name);
            let dims: Vec<u64> = w["dims"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
            assert_eq!(t.dims, dims, "{}", t.name);
            let rev: Vec<usize> = dims.iter().rev().map(|&d| d as usize).collect();
            assert_eq!(t.shape, rev, "{}", t.name);
            assert_eq!(t.offset, w["offset"].as_u64().unwrap(), "{}", t.name);
            assert_eq!(t.n_bytes, w["n_bytes"].as_u64().unwrap(), "{}", t.name);
            assert_eq!(f.raw(&t.name).unwrap().len() as u64, t.n_bytes);
        }
    }
}

#[test]
fn metadata_parses_as_written() {
    let f = GgufFile::open(&fixture("meta.gguf")).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32); // no general.alignment: the default
    assert!(f.metadata("general.alignment").is_none());
    let m = |k: &str| f.metadata(k).unwrap_or_else(|| panic!("missing {k}")).clone();
    assert_eq!(m("general.architecture").as_str(), Some("dsv4-test"));
    assert_eq!(m("t.u8"), GgufValue::U8(200));
    assert_eq!(m("t.i8"), GgufValue::I8(-100));
    assert_eq!(m("t.u16"), GgufValue::U16(60000));
    assert_eq!(m("t.i16"), GgufValue::I16(-30000));
    assert_eq!(m("t.u32"), GgufValue::U32(4_000_000_000));
    assert_eq!(m("t.i32"), GgufValue::I32(-2_000_000_000));
    assert_eq!(m("t.f32"), GgufValue::F32(0.1));
    assert_eq!(m("t.bool"), GgufValue::Bool(true));
    assert_eq!(m("t.string").as_str(), Some("héllo, GGUF"));
    assert_eq!(m("t.u64"), GgufValue::U64((1 << 63) + 5));
    assert_eq!(m("t.i64"), GgufValue::I64(-(1 << 62) - 7));
    assert_eq!(m("t.f64"), GgufValue::F64(0.1));
    assert_eq!(m("t.arr_i32"), GgufValue::Array(vec![GgufValue::I32(1), GgufValue::I32(-2), GgufValue::I32(3)]));
    assert_eq!(m("t.arr_u16"), GgufValue::Array([1, 2, 65535].map(GgufValue::U16).to_vec()));
    let strs: Vec<_> = m("t.arr_str").as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
    assert_eq!(strs, ["a", "", "ünï"]);
    assert_eq!(m("t.arr_f32"), GgufValue::Array(vec![GgufValue::F32(0.5), GgufValue::F32(-1.5)]));
    assert_eq!(m("t.arr_bool"), GgufValue::Array(vec![GgufValue::Bool(false), GgufValue::Bool(true)]));
    assert_eq!(
        m("t.arr_nested"),
        GgufValue::Array(vec![
            GgufValue::Array(vec![GgufValue::I32(1), GgufValue::I32(2)]),
            GgufValue::Array(vec![GgufValue::I32(3)]),
        ])
    );
    // Accessors widen integers.
    assert_eq!(m("t.u8").as_u64(), Some(200));
    assert_eq!(m("t.i8").as_i64(), Some(-100));
    assert_eq!(m("t.i8").as_u64(), None);
    assert_eq!(m("t.u32").as_f64(), Some(4e9));
    assert!(f.metadata("no.such.key").is_none());
    assert_eq!(f.metadata_all().first().map(|(k, _)| k.as_str()), Some("general.architecture"));

    // Tensors of every plain type, in row-major shape.
    assert_eq!(f.f32("vec").unwrap(), [0.0, 1.0, 2.0, 3.0, 4.0]);
    let w = f.info("blk.0.w").unwrap();
    assert_eq!((w.dtype, w.dims.clone(), w.shape.clone()), (GgmlType::F16, vec![4, 3, 2], vec![2, 3, 4]));
    assert_eq!(f.f32("blk.0.w").unwrap(), (0..24).map(|i| i as f32).collect::<Vec<_>>());
    assert_eq!(f.i32("idx").unwrap(), (0..12).collect::<Vec<_>>());
    assert_eq!(f.info("idx").unwrap().shape, [4, 3]);
}

#[test]
fn missing_tensor_is_named() {
    let f = blocks();
    let e = f.f32("nope").unwrap_err();
    assert!(matches!(e, GgufError::Missing { .. }));
    let s = e.to_string();
    assert!(s.contains("nope") && s.contains("blocks.gguf"), "{s}");
}

#[test]
fn truncated_file_errors_naming_a_tensor() {
    let bytes = std::fs::read(fixture("blocks.gguf")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let f = blocks();
    let last = f.tensors().iter().max_by_key(|t| t.offset).unwrap().clone();
    let first = f.tensors().iter().min_by_key(|t| t.offset).unwrap().clone();
    // Cut one byte: only the last tensor is affected.
    let p = dir.path().join("cut.gguf");
    std::fs::write(&p, &bytes[..bytes.len() - 1]).unwrap();
    let e = GgufFile::open(&p).err().expect("truncated file must fail");
    let s = e.to_string();
    assert!(matches!(&e, GgufError::Truncated { tensor, .. } if *tensor == last.name), "{s}");
    assert!(s.contains(&format!("`{}`", last.name)) && s.contains("cut.gguf") && s.contains("truncated"), "{s}");
    // Cut right after the header: the first tensor already fails.
    std::fs::write(&p, &bytes[..f.data_start() + 10]).unwrap();
    let e = GgufFile::open(&p).err().unwrap();
    assert!(e.to_string().contains(&format!("`{}`", first.name)) || matches!(e, GgufError::Truncated { .. }), "{e}");
    // Cut inside the header: a header error, not a panic.
    for n in [0, 3, 7, 20, 100, 300] {
        std::fs::write(&p, &bytes[..n]).unwrap();
        let e = GgufFile::open(&p).err().unwrap_or_else(|| panic!("{n} bytes opened"));
        assert!(matches!(e, GgufError::Header { .. }), "{n}: {e}");
    }
}

#[test]
fn bad_headers_are_refused() {
    let bytes = std::fs::read(fixture("meta.gguf")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.gguf");
    let try_open = |b: &[u8]| {
        std::fs::write(&p, b).unwrap();
        GgufFile::open(&p).err().map(|e| e.to_string())
    };
    let mut b = bytes.clone();
    b[0] = b'X';
    assert!(try_open(&b).unwrap().contains("magic"));
    let mut b = bytes.clone();
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(try_open(&b).unwrap().contains("version 1"));
    let mut b = bytes.clone();
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(try_open(&b).unwrap().contains("big-endian"));
    // An absurd tensor count is refused before anything is allocated for it.
    let mut b = bytes.clone();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(try_open(&b).unwrap().contains("cannot fit"));
    assert!(try_open(&bytes).is_none());
}

#[test]
fn q8_0_quantiser_is_bitwise_equal_to_the_gguf_package() {
    let f = blocks();
    let src = f.f32("q8_0.src").unwrap();
    let q = quant::quantize_q8_0(&src);
    let want = f.raw("q8_0").unwrap();
    assert_eq!(q.len(), want.len());
    if let Some(i) = (0..q.len()).find(|&i| q[i] != want[i]) {
        panic!("Q8_0 byte {i} (block {}): got {} want {}", i / 34, q[i], want[i]);
    }
    // Round trip: |x − x̂| ≤ d/2 plus the f16 rounding of d (127·d·2⁻¹¹).
    let mut back = vec![0f32; src.len()];
    quant::dequant_q8_0(&q, &mut back);
    for (xb, yb) in src.chunks(32).zip(back.chunks(32)) {
        let d = xb.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
        for (x, y) in xb.iter().zip(yb) {
            assert!((x - y).abs() <= d * (0.5 + 127.0 / 2048.0) + 1e-30, "{x} → {y} (d {d})");
        }
    }
}

/// Per-block RMS error of a K-quant round trip, relative to the block's RMS.
fn rel_rms_errors(x: &[f32], y: &[f32]) -> Vec<f32> {
    x.chunks(256)
        .zip(y.chunks(256))
        .map(|(a, b)| {
            let e: f32 = a.iter().zip(b).map(|(p, q)| (p - q) * (p - q)).sum();
            let s: f32 = a.iter().map(|p| p * p).sum();
            if s == 0.0 {
                e.sqrt()
            } else {
                (e / s).sqrt()
            }
        })
        .collect()
}

#[test]
fn k_quantisers_round_trip_within_their_format_error() {
    let f = blocks();
    let x = f.f32("kquant.src").unwrap();
    let mut y = vec![0f32; x.len()];
    // Q4_K: 4.5 bits; gaussian blocks come back within ~10% RMS; each value within one step of its
    // sub-block (d·scale) plus the step of the min.
    let q4 = quant::quantize_q4_k(&x);
    assert_eq!(q4.len(), x.len() / 256 * quant::Q4_K_BYTES);
    quant::dequant_q4_k(&q4, &mut y);
    let e4 = rel_rms_errors(&x, &y);
    // Q2_K: 2.6 bits; within ~45% RMS.
    let q2 = quant::quantize_q2_k(&x);
    assert_eq!(q2.len(), x.len() / 256 * quant::Q2_K_BYTES);
    let mut y2 = vec![0f32; x.len()];
    quant::dequant_q2_k(&q2, &mut y2);
    let e2 = rel_rms_errors(&x, &y2);
    for b in 0..x.len() / 256 {
        let xb = &x[256 * b..256 * b + 256];
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        if amax == 0.0 || xb.iter().all(|&v| v == xb[0]) {
            // zero / constant blocks are reproduced (almost) exactly
            assert!(e4[b] < 1e-3 && e2[b] < 1e-3, "block {b}: {} {}", e4[b], e2[b]);
            continue;
        }
        assert!(e4[b] < 0.12, "Q4_K block {b}: relative RMS error {}", e4[b]);
        assert!(e2[b] < 0.5, "Q2_K block {b}: relative RMS error {}", e2[b]);
        for (i, (p, q)) in xb.iter().zip(&y[256 * b..256 * b + 256]).enumerate() {
            assert!((p - q).abs() <= amax / 7.0, "Q4_K block {b} value {i}: {p} → {q}");
        }
    }
}

#[test]
fn k_quantisers_reproduce_blocks_that_are_already_on_the_grid() {
    // Values on a block's grid (levels 0..15, resp. 0..3, times one step, every sub-block spanning
    // the full range) come back up to the f16 rounding of the super-block scale (2^-11 relative).
    let x: Vec<f32> = (0..512).map(|i| ((i * 7) % 16) as f32 * 0.125).collect();
    let q = quant::quantize_q4_k(&x);
    let mut y = vec![0f32; x.len()];
    quant::dequant_q4_k(&q, &mut y);
    for (a, b) in x.iter().zip(&y) {
        assert!((a - b).abs() <= 1.875 / 1024.0, "Q4_K {a} → {b}");
    }
    let x: Vec<f32> = (0..512).map(|i| ((i * 5) % 4) as f32 * 0.5).collect();
    let q = quant::quantize_q2_k(&x);
    quant::dequant_q2_k(&q, &mut y);
    for (a, b) in x.iter().zip(&y) {
        assert!((a - b).abs() <= 1.5 / 1024.0, "Q2_K {a} → {b}");
    }
}
