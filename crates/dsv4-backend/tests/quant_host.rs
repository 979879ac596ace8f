//! The CUDA kernels' dequantisation (`deq8` in `cuda/kernels/quant.cu`) compiled for the host
//! and checked bit for bit against the CPU decoders (`dsv4_model::quant`) on random blocks of
//! every packed format, so an edit of the device decode is checked without a GPU. The device
//! intrinsics it uses get host definitions with the same IEEE results (`__fmul_rn` is a plain
//! f32 multiply with contraction off, `__byte_perm` picks bytes). Needs a C++17 compiler
//! (`$CXX`, else `c++`); prints "skipping: no C++ compiler" without one.

use dsv4_model::packed::PackedFormat;
use dsv4_model::quant::{
    dequant_fp4, dequant_fp8_blocks, dequant_iq2_xxs, dequant_q2_k, dequant_q4_k, dequant_q8_0, e8m0_to_f32,
};
use rand::{Rng, SeedableRng};
use std::path::Path;
use std::process::Command;

const QUANT_CU: &str = include_str!("../src/cuda/kernels/quant.cu");

const SHIM: &str = r#"
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#define __device__
#define __forceinline__ inline
#define __restrict__
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __uint2float_rn(unsigned x) { return (float)x; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned n) {
    unsigned long long v = ((unsigned long long)hi << 32) | lo;
    return (unsigned)(v >> (n & 31));
}
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    unsigned char b[8];
    std::memcpy(b, &x, 4);
    std::memcpy(b + 4, &y, 4);
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned)b[(s >> (4 * i)) & 7] << (8 * i);
    return r;
}
"#;

/// Reads records `(format, k, row bytes, scale bytes, row, scales)` from stdin (GGUF formats:
/// the code plane and the head plane of the row, as the uploader splits them) and writes each
/// row's `k` dequantised values (`deq8` over c = 0, 8, 16, …) to stdout.
const MAIN: &str = r#"
template <int F> static void row(const u8* w, const u8* s, int k, float* out) {
    for (int c = 0; c < k; c += 8) deq8<F>(w, s, c, out + c);
}
// Format ids + 100: the int8 path's `xdot32` over each 32-value chunk, the activations and
// their scales following the row's heads (k int8, then k/32 floats); the accumulator starts at
// 0.375.
// ONE: the one-row kernels' form instead (`xapply32_one`), ids + 150; SPLIT: the several-row
// groups' two dp4a chains (`xapply32<F, true>`), ids + 180.
template <int F, bool ONE = false, bool SPLIT = false> static void xrow(const u8* w, const u8* s, int k, float* out) {
    const u8* h = s;
    s += head_bytes(F, k);
    const signed char* xq = (const signed char*)s;
    const float* xd = (const float*)(s + k);
    for (int c = 0; c < k; c += 32) {
        int x[8];
        std::memcpy(x, xq + c, 32);
        out[c / 32] = ONE     ? xapply32_one<F>(xraw32<F>(w, h, c), c, x, xd[c / 32], 0.375f)
                      : SPLIT ? xapply32<F, true>(xdecode32<F>(w, h, c), x, xd[c / 32], 0.375f)
                              : xdot32<F>(w, h, c, x, xd[c / 32], 0.375f);
    }
}
int main() {
    int hdr[4];
    while (fread(hdr, 4, 4, stdin) == 4) {
        int f = hdr[0], k = hdr[1];
        if (f == 200) {  // k IQ2_XXS sign words through iq2_even_signs (the synthetic draw's fix-up)
            std::vector<unsigned> w(k);
            if (fread(w.data(), 4, k, stdin) != (size_t)k) return 2;
            for (auto& x : w) x = iq2_even_signs(x);
            fwrite(w.data(), 4, k, stdout);
            continue;
        }
        if (f >= 100) {
            std::vector<u8> w(hdr[2]), s(hdr[3]);
            if (fread(w.data(), 1, w.size(), stdin) != w.size() || fread(s.data(), 1, s.size(), stdin) != s.size()) return 2;
            std::vector<float> out(k / 32);
            switch (f - 100) {
                case F_Q8_0: xrow<F_Q8_0>(w.data(), s.data(), k, out.data()); break;
                case F_Q2_K: xrow<F_Q2_K>(w.data(), s.data(), k, out.data()); break;
                case F_IQ2_XXS: xrow<F_IQ2_XXS>(w.data(), s.data(), k, out.data()); break;
                case 50 + F_Q8_0: xrow<F_Q8_0, true>(w.data(), s.data(), k, out.data()); break;
                case 50 + F_Q2_K: xrow<F_Q2_K, true>(w.data(), s.data(), k, out.data()); break;
                case 50 + F_IQ2_XXS: xrow<F_IQ2_XXS, true>(w.data(), s.data(), k, out.data()); break;
                case 80 + F_Q8_0: xrow<F_Q8_0, false, true>(w.data(), s.data(), k, out.data()); break;
                case 80 + F_Q2_K: xrow<F_Q2_K, false, true>(w.data(), s.data(), k, out.data()); break;
                case 80 + F_IQ2_XXS: xrow<F_IQ2_XXS, false, true>(w.data(), s.data(), k, out.data()); break;
                default: return 3;
            }
            fwrite(out.data(), 4, k / 32, stdout);
            continue;
        }
        std::vector<u8> w(hdr[2]), s(hdr[3] + 16);
        if (fread(w.data(), 1, w.size(), stdin) != w.size() || fread(s.data(), 1, hdr[3], stdin) != (size_t)hdr[3]) return 2;
        std::vector<float> out(k);
        switch (f) {
            case F_Q8_0: row<F_Q8_0>(w.data(), s.data(), k, out.data()); break;
            case F_Q4_K: row<F_Q4_K>(w.data(), s.data(), k, out.data()); break;
            case F_Q2_K: row<F_Q2_K>(w.data(), s.data(), k, out.data()); break;
            case F_IQ2_XXS: row<F_IQ2_XXS>(w.data(), s.data(), k, out.data()); break;
            case F_FP8: row<F_FP8>(w.data(), s.data(), k, out.data()); break;
            case F_FP4: row<F_FP4>(w.data(), s.data(), k, out.data()); break;
            case F_BF16: row<F_BF16>(w.data(), s.data(), k, out.data()); break;
            default: return 3;
        }
        fwrite(out.data(), 4, k, stdout);
    }
    return 0;
}
"#;

/// The device decode: `quant.cu` from its format ids up to the first dot product, with the
/// IQ2_XXS tables the launcher prepends (`cuda::quant::source`).
fn device_decode() -> String {
    let a = QUANT_CU.find("#define F_Q8_0").expect("format ids in quant.cu");
    let b = QUANT_CU.find("// ---- end of the per-lane decode").expect("the end marker in quant.cu");
    format!(
        "{SHIM}\n{}\n{}\n{MAIN}",
        dsv4_backend::x8::iq2_tables_source("static const"),
        QUANT_CU[a..b].replace("__device__ const float E2M1", "static const float E2M1")
    )
}

fn compile(dir: &Path) -> Option<std::path::PathBuf> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let src = dir.join("deq8.cpp");
    std::fs::write(&src, device_decode()).unwrap();
    let exe = dir.join("deq8");
    let out = Command::new(&cxx).args(["-O2", "-ffp-contract=off", "-std=c++17", "-o"]).arg(&exe).arg(&src).output();
    match out {
        Err(_) => None,
        Ok(o) if !o.status.success() => {
            panic!("{cxx} failed on the host build of quant.cu:\n{}", String::from_utf8_lossy(&o.stderr))
        }
        Ok(_) => Some(exe),
    }
}

/// f16 bits: a normal value of magnitude 2^-5..2^3 with probability 15/16, else raw bits
/// (zero, subnormals, ±∞ and NaN too).
fn f16_bits(rng: &mut impl Rng) -> [u8; 2] {
    if rng.gen_range(0..16) == 0 {
        return rng.gen::<u16>().to_le_bytes();
    }
    let (sign, exp, man) = (rng.gen_range(0..2u16), rng.gen_range(10..18u16), rng.gen_range(0..1024u16));
    ((sign << 15) | (exp << 10) | man).to_le_bytes()
}

struct Case {
    format: i32,
    k: usize,
    row: Vec<u8>,
    scales: Vec<u8>,
    want: Vec<f32>,
}

/// Format ids as numbered in quant.cu.
const FORMATS: [PackedFormat; 4] = [PackedFormat::Q8_0, PackedFormat::Q4_K, PackedFormat::Q2_K, PackedFormat::IQ2_XXS];

impl Case {
    /// The row and scale bytes as the device holds them: a GGUF row split into its planes.
    fn device_planes(&self) -> (Vec<u8>, Vec<u8>) {
        match FORMATS.get(self.format as usize) {
            Some(f) => f.planes().unwrap().split(&self.row),
            None => (self.row.clone(), self.scales.clone()),
        }
    }
}

fn case(format: i32, k: usize, rng: &mut impl Rng) -> Case {
    let row: Vec<u8>;
    let mut scales: Vec<u8> = Vec::new();
    let mut want = vec![0f32; k];
    let mut blocks = |bytes: usize, n: usize, scale_at: &[usize]| {
        let mut r = vec![0u8; bytes * (k / n)];
        rng.fill(&mut r[..]);
        for b in r.chunks_mut(bytes) {
            for &o in scale_at {
                b[o..o + 2].copy_from_slice(&f16_bits(rng));
            }
        }
        r
    };
    match format {
        0 => {
            row = blocks(34, 32, &[0]);
            dequant_q8_0(&row, &mut want);
        }
        1 => {
            row = blocks(144, 256, &[0, 2]);
            dequant_q4_k(&row, &mut want);
        }
        2 => {
            row = blocks(84, 256, &[80, 82]);
            dequant_q2_k(&row, &mut want);
        }
        3 => {
            row = blocks(66, 256, &[0]);
            dequant_iq2_xxs(&row, &mut want);
        }
        4 => {
            row = (0..k).map(|_| rng.gen()).collect();
            let s: Vec<f32> = (0..k.div_ceil(128)).map(|_| rng.gen_range(-3.0f32..3.0)).collect();
            scales = s.iter().flat_map(|x| x.to_le_bytes()).collect();
            want = dequant_fp8_blocks(&row, &s, 1, k, 128);
        }
        5 => {
            row = (0..k / 2).map(|_| rng.gen()).collect();
            scales = (0..k / 32).map(|_| rng.gen()).collect();
            let s: Vec<f32> = scales.iter().map(|&b| e8m0_to_f32(b)).collect();
            want = dequant_fp4(&row, &s, 1, k, 32);
        }
        _ => {
            row = (0..2 * k).map(|_| rng.gen()).collect();
            want = row.chunks(2).map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)).collect();
        }
    }
    Case { format, k, row, scales, want }
}

#[test]
fn device_dequant_built_for_the_host_equals_the_cpu_decoders() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile(dir.path()) else {
        println!("skipping: no C++ compiler");
        return;
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
    // Formats as numbered in quant.cu: Q8_0, Q4_K, Q2_K, IQ2_XXS, FP8, FP4, BF16.
    let cases: Vec<Case> = (0..7).flat_map(|f| (0..200).map(move |_| f)).map(|f| case(f, 1024, &mut rng)).collect();
    let mut input = Vec::new();
    for c in &cases {
        let (row, scales) = c.device_planes();
        for v in [c.format, c.k as i32, row.len() as i32, scales.len() as i32] {
            input.extend(v.to_le_bytes());
        }
        input.extend(&row);
        input.extend(&scales);
    }
    let inp = dir.path().join("in.bin");
    std::fs::write(&inp, &input).unwrap();
    let out = Command::new(&exe).stdin(std::fs::File::open(&inp).unwrap()).output().unwrap();
    assert!(out.status.success(), "host deq8 exited with {:?}", out.status);
    let got: Vec<f32> = out.stdout.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    assert_eq!(got.len(), cases.iter().map(|c| c.k).sum::<usize>());
    let names = ["Q8_0", "Q4_K", "Q2_K", "IQ2_XXS", "FP8", "FP4", "BF16"];
    let mut off = 0;
    let mut checked = [0usize; 7];
    for c in &cases {
        for (i, (&g, &w)) in got[off..off + c.k].iter().zip(&c.want).enumerate() {
            let same = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
            assert!(
                same,
                "{} value {i}: device decode {g:e} ({:08x}), CPU {w:e} ({:08x})",
                names[c.format as usize],
                g.to_bits(),
                w.to_bits()
            );
        }
        checked[c.format as usize] += c.k;
        off += c.k;
    }
    println!(
        "bitwise equal: {}",
        names.iter().zip(checked).map(|(n, k)| format!("{n} {k}")).collect::<Vec<_>>().join(", ")
    );
}

/// The int8 path's per-chunk product (`xdot32`) built for the host equals its CPU twin
/// (`dsv4_backend::x8::xdot32`) bit for bit, for the three formats it serves; so does the
/// one-row kernels' form (`xapply32_one`: Q2_K's codes masked in place) and the several-row
/// groups' form (`xapply32<F, true>`: two dp4a chains).
#[test]
fn device_int8_products_built_for_the_host_equal_the_twin() {
    use dsv4_backend::x8;
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile(dir.path()) else {
        println!("skipping: no C++ compiler");
        return;
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    let k = 1024;
    let formats = [(0, PackedFormat::Q8_0), (2, PackedFormat::Q2_K), (3, PackedFormat::IQ2_XXS)];
    let mut input = Vec::new();
    let mut want: Vec<f32> = Vec::new();
    for &(id, f) in &formats {
        for _ in 0..200 {
            let c = case(id, k, &mut rng);
            let x: Vec<f32> = (0..k).map(|_| rng.gen_range(-4.0f32..4.0)).collect();
            let (xq, xd) = x8::quantize(&x);
            let (codes, mut side) = c.device_planes();
            side.extend(xq.iter().map(|&q| q as u8));
            side.extend(xd.iter().flat_map(|d| d.to_le_bytes()));
            let twin: Vec<f32> =
                (0..k).step_by(32).map(|ch| x8::xdot32(f, &c.row, ch, &xq[ch..ch + 32], xd[ch / 32], 0.375)).collect();
            for form in [100, 150, 180] {
                for v in [form + id, k as i32, codes.len() as i32, side.len() as i32] {
                    input.extend(v.to_le_bytes());
                }
                input.extend(&codes);
                input.extend(&side);
                want.extend(&twin);
            }
        }
    }
    let inp = dir.path().join("x8.bin");
    std::fs::write(&inp, &input).unwrap();
    let out = Command::new(&exe).stdin(std::fs::File::open(&inp).unwrap()).output().unwrap();
    assert!(out.status.success(), "host xdot32 exited with {:?}", out.status);
    let got: Vec<f32> = out.stdout.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let same = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
        let case = i / (k / 32);
        let form = ["xdot32", "xapply32_one", "xapply32 (two chains)"][case % 3];
        assert!(same, "chunk {i} ({}, {form}): device {g:e}, twin {w:e}", formats[case / 600].1.name());
    }
    println!("int8 chunks bitwise equal: {}", got.len());
}

/// The synthetic draw's fix-up of random IQ2_XXS sign words (`iq2_even_signs`, built for the
/// host) makes every word one `Planes::join` accepts, changes only the 8th sign of a grid entry
/// (`iq2_sign_bit(2kk + 1, 3)`), and keeps the words that are already valid (those of GGUF blocks).
#[test]
fn iq2_even_signs_built_for_the_host_gives_gguf_sign_words() {
    use dsv4_model::packed::{iq2_gguf_signs, iq2_sign_bit, iq2_sign_word};
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile(dir.path()) else {
        println!("skipping: no C++ compiler");
        return;
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(10);
    let n = 20000;
    let mut words: Vec<u32> = (0..n).map(|_| rng.gen()).collect();
    words.extend((0..n).map(|_| iq2_sign_word(rng.gen::<u32>() & 0x0fff_ffff)));
    let mut input = Vec::new();
    for v in [200, words.len() as i32, 0, 0] {
        input.extend(v.to_le_bytes());
    }
    input.extend(words.iter().flat_map(|w| w.to_le_bytes()));
    let inp = dir.path().join("signs.bin");
    std::fs::write(&inp, &input).unwrap();
    let out = Command::new(&exe).stdin(std::fs::File::open(&inp).unwrap()).output().unwrap();
    assert!(out.status.success(), "host iq2_even_signs exited with {:?}", out.status);
    let got: Vec<u32> = out.stdout.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    assert_eq!(got.len(), words.len());
    let eighth: u32 = (0..4).map(|kk| 1u32 << iq2_sign_bit(2 * kk + 1, 3)).sum();
    let mut fixed = 0;
    for (i, (&w, &g)) in words.iter().zip(&got).enumerate() {
        assert!(iq2_gguf_signs(g).is_some(), "word {i}: {w:08x} → {g:08x} has an odd grid entry");
        assert_eq!((w ^ g) & !eighth, 0, "word {i}: {w:08x} → {g:08x} changed more than the 8th signs");
        if i >= n {
            assert_eq!(g, w, "word {i}: a valid word changed");
        }
        fixed += (w != g) as usize;
    }
    // About 15/16 of random words have some odd grid entry.
    assert!(fixed > n * 7 / 8 && fixed < n, "{fixed} of {n} random words fixed");
}
