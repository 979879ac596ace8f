//! Weights kept in their stored block format.
//!
//! A backend that dequantises inside its kernels (the CUDA backend) is handed the file's blocks
//! as they are, so a q2 V4-Flash takes ~2.25 bits per expert weight on the device instead of 16.
//! The CPU oracle calls [`Packed::dequantize`], which uses the same decoders as loading
//! dequantised weights, so both backends see the same values.

use crate::gguf::{self, GgmlType};
use crate::quant::{dequant_fp4, dequant_fp8_blocks};

/// The block formats a weight can stay in.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PackedFormat {
    /// GGUF Q8_0: 32 values in 34 bytes.
    Q8_0,
    /// GGUF Q4_K: 256 values in 144 bytes.
    Q4_K,
    /// GGUF Q2_K: 256 values in 84 bytes.
    Q2_K,
    /// GGUF IQ2_XXS: 256 values in 66 bytes.
    IQ2_XXS,
    /// Official FP8 E4M3, one byte per value, f32 scales per 128×128 block.
    Fp8,
    /// Official FP4 E2M1 experts, two values per byte (low nibble first), f32 (UE8M0-valued)
    /// scales per 32 consecutive inputs of a row.
    Fp4,
}

/// Side of the square FP8 scale blocks.
pub const FP8_BLOCK: usize = 128;
/// Inputs sharing one FP4 scale.
pub const FP4_GROUP: usize = 32;

impl PackedFormat {
    pub const ALL: [PackedFormat; 6] = [
        PackedFormat::Q8_0,
        PackedFormat::Q4_K,
        PackedFormat::Q2_K,
        PackedFormat::IQ2_XXS,
        PackedFormat::Fp8,
        PackedFormat::Fp4,
    ];

    /// The packed format of a GGUF block type, if it is one.
    pub fn of_ggml(t: GgmlType) -> Option<Self> {
        Some(match t {
            GgmlType::Q8_0 => PackedFormat::Q8_0,
            GgmlType::Q4_K => PackedFormat::Q4_K,
            GgmlType::Q2_K => PackedFormat::Q2_K,
            GgmlType::IQ2_XXS => PackedFormat::IQ2_XXS,
            _ => return None,
        })
    }

    /// The GGUF type of a GGUF format.
    pub fn ggml(self) -> Option<GgmlType> {
        Some(match self {
            PackedFormat::Q8_0 => GgmlType::Q8_0,
            PackedFormat::Q4_K => GgmlType::Q4_K,
            PackedFormat::Q2_K => GgmlType::Q2_K,
            PackedFormat::IQ2_XXS => GgmlType::IQ2_XXS,
            PackedFormat::Fp8 | PackedFormat::Fp4 => return None,
        })
    }

    /// Values per block along a row (a row must be a whole number of blocks).
    pub fn block(self) -> usize {
        match self {
            PackedFormat::Q8_0 => 32,
            PackedFormat::Q4_K | PackedFormat::Q2_K | PackedFormat::IQ2_XXS => 256,
            PackedFormat::Fp8 => 1,
            PackedFormat::Fp4 => FP4_GROUP,
        }
    }

    /// Block bytes of one row of `cols` values (scales of the official formats not included).
    pub fn row_bytes(self, cols: usize) -> usize {
        match self.ggml() {
            Some(t) => t.row_bytes(cols),
            None if self == PackedFormat::Fp8 => cols,
            None => cols / 2,
        }
    }

    /// Number of f32 scales of a `[rows, cols]` weight stored beside the blocks.
    pub fn n_scales(self, rows: usize, cols: usize) -> usize {
        match self {
            PackedFormat::Fp8 => rows.div_ceil(FP8_BLOCK) * cols.div_ceil(FP8_BLOCK),
            PackedFormat::Fp4 => rows * cols.div_ceil(FP4_GROUP),
            _ => 0,
        }
    }

    /// Whether a `[rows, cols]` weight can be stored in this format.
    pub fn fits(self, cols: usize) -> bool {
        cols > 0 && cols.is_multiple_of(self.block())
    }

    /// Bits per weight including scales (for memory reports).
    pub fn bits_per_weight(self) -> f64 {
        match self {
            PackedFormat::Fp8 => 8.0 + 32.0 / (FP8_BLOCK * FP8_BLOCK) as f64,
            PackedFormat::Fp4 => 4.0 + 8.0 / FP4_GROUP as f64,
            f => f.ggml().map(|t| 8.0 * t.type_size() as f64 / t.block_size() as f64).unwrap_or(0.0),
        }
    }

    /// How a device holds a GGUF format's blocks: split into their codes and the rest.
    pub fn planes(self) -> Option<Planes> {
        let (block_bytes, code_off, code_len) = match self {
            PackedFormat::Q8_0 => (34, 2, 32),
            PackedFormat::Q4_K => (144, 16, 128),
            PackedFormat::Q2_K => (84, 16, 64),
            PackedFormat::IQ2_XXS => (66, 2, 64),
            PackedFormat::Fp8 | PackedFormat::Fp4 => return None,
        };
        Some(Planes { block_bytes, code_off, code_len, iq2_signs: self == PackedFormat::IQ2_XXS })
    }

    pub fn name(self) -> &'static str {
        match self {
            PackedFormat::Q8_0 => "Q8_0",
            PackedFormat::Q4_K => "Q4_K",
            PackedFormat::Q2_K => "Q2_K",
            PackedFormat::IQ2_XXS => "IQ2_XXS",
            PackedFormat::Fp8 => "FP8",
            PackedFormat::Fp4 => "FP4",
        }
    }
}

/// A GGUF block as two planes: its code bytes (one contiguous run of the block, 16-byte
/// aligned when a row's blocks follow each other: Q8_0's int8s, the K formats' `qs`, IQ2_XXS's
/// grid words) and its head (every other byte in order: d, dmin, sub-block scales). GGUF blocks
/// are 34/66/84/144 bytes, so in place their codes sit at 2- or 4-byte alignment and a kernel
/// loads them in narrow pieces (ncu: 12 of each 32-byte sector used, 61 % excess L2 sectors on
/// Q8_0, PERF.md v8); split, a lane loads its codes in one 8- or 16-byte load.
///
/// IQ2_XXS (`iq2_signs`) is also repacked, so that its decode spends fewer instructions on
/// signs (PERF.md v16, v26). GGUF holds a 32-value sub-block as two words: 4 grid indices, and
/// 4 × 7 sign bits (each grid entry's 8th sign is implicit: an even number of negatives per 8
/// values) under a 4-bit scale. The planes hold, per sub-block, 8 code bytes: the grid word as
/// it is, then a sign word with all 32 signs, bit [`iq2_sign_bit`]`(q, i)` = `4i + q mod 4 +
/// 16·⌊q / 4⌋` the sign of value `4q + i` (quad `q` = 0..8 of 4 values, `i` = 0..4). So one
/// rotation puts quad `q`'s 4 signs at bits 2, 6, 10 and 14, the kernels or them into the quad's
/// byte-permute selector (a nibble a value: the grid level 0..2, plus 4 where negative), and one
/// `prmt` of the magnitudes (8, 25, 43) and their negatives gives the quad's signed codes. The head of a block is 8
/// bytes, one 32-bit word per 128 values: the scales of its 4 sub-blocks (the `j`th's at bits
/// 4j) in the low half, d (f16) in the high half, so d is held twice and a lane reads its
/// chunk's d and scale in one 4-byte load. 72 bytes a block on the device instead of
/// GGUF's 66. [`Self::join`] gives the GGUF blocks back, and refuses a sign word whose grid
/// entries do not have an even number of negatives (GGUF cannot hold it) or heads whose two
/// copies of d differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planes {
    pub block_bytes: usize,
    /// Where the codes start in a block, and how many bytes they take.
    pub code_off: usize,
    pub code_len: usize,
    /// IQ2_XXS's repacked sign words and 8-byte heads (see above).
    pub iq2_signs: bool,
}

/// The bit of a planes sign word that holds the sign of value `4q + i` of its sub-block (see
/// [`Planes`]).
pub const fn iq2_sign_bit(q: u32, i: u32) -> u32 {
    4 * i + (q & 3) + 16 * (q >> 2)
}

/// IQ2_XXS's 32 signs of a sub-block in the planes' order from GGUF's 4 × 7 stored bits (the low
/// 28 bits of `aux`; the 8th sign of each grid entry is the parity of its 7).
pub fn iq2_sign_word(aux: u32) -> u32 {
    let mut s = 0u32;
    for kk in 0..4 {
        let s7 = (aux >> (7 * kk)) & 127;
        let s8 = s7 | ((s7.count_ones() & 1) << 7);
        for j in 0..8 {
            let (q, i) = (2 * kk + j / 4, j % 4);
            s |= ((s8 >> j) & 1) << iq2_sign_bit(q, i);
        }
    }
    s
}

/// The inverse of [`iq2_sign_word`]: GGUF's 4 × 7 sign bits, or `None` when a grid entry has an
/// odd number of negatives.
pub fn iq2_gguf_signs(s: u32) -> Option<u32> {
    let mut aux = 0u32;
    for kk in 0..4 {
        let mut s8 = 0u32;
        for j in 0..8 {
            let (q, i) = (2 * kk + j / 4, j % 4);
            s8 |= ((s >> iq2_sign_bit(q, i)) & 1) << j;
        }
        if s8.count_ones() % 2 == 1 {
            return None;
        }
        aux |= (s8 & 127) << (7 * kk);
    }
    Some(aux)
}

/// IQ2_XXS head bytes a block on the device (see [`Planes`]).
const IQ2_HEAD: usize = 8;

impl Planes {
    pub fn head_len(&self) -> usize {
        if self.iq2_signs {
            IQ2_HEAD
        } else {
            self.block_bytes - self.code_len
        }
    }

    /// Device bytes of a block (both planes).
    pub fn device_block_bytes(&self) -> usize {
        self.code_len + self.head_len()
    }

    /// (codes, heads) of whole blocks, each plane in block order.
    pub fn split(&self, blocks: &[u8]) -> (Vec<u8>, Vec<u8>) {
        assert!(blocks.len().is_multiple_of(self.block_bytes), "{} bytes are not whole blocks", blocks.len());
        let n = blocks.len() / self.block_bytes;
        let (mut codes, mut heads) = (Vec::with_capacity(n * self.code_len), Vec::with_capacity(n * self.head_len()));
        let end = self.code_off + self.code_len;
        for b in blocks.chunks_exact(self.block_bytes) {
            if self.iq2_signs {
                let mut scales = 0u32;
                for (j, sub) in b[self.code_off..end].chunks_exact(8).enumerate() {
                    let aux = u32::from_le_bytes([sub[4], sub[5], sub[6], sub[7]]);
                    codes.extend_from_slice(&sub[..4]);
                    codes.extend_from_slice(&iq2_sign_word(aux).to_le_bytes());
                    scales |= (aux >> 28) << (4 * j);
                }
                for h in 0..2 {
                    heads.extend_from_slice(&((scales >> (16 * h)) as u16).to_le_bytes());
                    heads.extend_from_slice(&b[..2]);
                }
                continue;
            }
            heads.extend_from_slice(&b[..self.code_off]);
            codes.extend_from_slice(&b[self.code_off..end]);
            heads.extend_from_slice(&b[end..]);
        }
        (codes, heads)
    }

    /// The blocks [`Self::split`] took apart; an error for IQ2_XXS planes that are not GGUF
    /// blocks (see [`Planes`]).
    pub fn join(&self, codes: &[u8], heads: &[u8]) -> Result<Vec<u8>, String> {
        let n = codes.len() / self.code_len;
        if codes.len() != n * self.code_len || heads.len() != n * self.head_len() {
            return Err(format!("planes of {} and {} bytes are not {n} blocks", codes.len(), heads.len()));
        }
        let mut out = Vec::with_capacity(n * self.block_bytes);
        for (bi, (c, h)) in codes.chunks_exact(self.code_len).zip(heads.chunks_exact(self.head_len())).enumerate() {
            if self.iq2_signs {
                if h[2..4] != h[6..8] {
                    return Err(format!("IQ2_XXS block {bi}: the head's two copies of d differ"));
                }
                let scales = u16::from_le_bytes([h[0], h[1]]) as u32 | (u16::from_le_bytes([h[4], h[5]]) as u32) << 16;
                out.extend_from_slice(&h[2..4]);
                for (j, sub) in c.chunks_exact(8).enumerate() {
                    let s = u32::from_le_bytes([sub[4], sub[5], sub[6], sub[7]]);
                    let aux = iq2_gguf_signs(s).ok_or_else(|| {
                        format!("IQ2_XXS block {bi} sub-block {j}: a grid entry with an odd number of negatives")
                    })?;
                    out.extend_from_slice(&sub[..4]);
                    out.extend_from_slice(&(aux | ((scales >> (4 * j)) & 15) << 28).to_le_bytes());
                }
                continue;
            }
            out.extend_from_slice(&h[..self.code_off]);
            out.extend_from_slice(c);
            out.extend_from_slice(&h[self.code_off..]);
        }
        Ok(out)
    }
}

/// A `[rows, cols]` weight in its stored format: `blocks` row-major (`rows · row_bytes(cols)`
/// bytes) and, for the official formats, `scales` (see [`PackedFormat::n_scales`]).
#[derive(Clone, Debug)]
pub struct Packed {
    pub format: PackedFormat,
    pub blocks: Vec<u8>,
    pub scales: Vec<f32>,
}

impl Packed {
    /// The f32 values, exactly as the loader's dequantising path produces them.
    pub fn dequantize(&self, rows: usize, cols: usize) -> Vec<f32> {
        match self.format {
            PackedFormat::Fp8 => dequant_fp8_blocks(&self.blocks, &self.scales, rows, cols, FP8_BLOCK),
            PackedFormat::Fp4 => dequant_fp4(&self.blocks, &self.scales, rows, cols, FP4_GROUP),
            f => {
                let mut out = vec![0f32; rows * cols];
                gguf::decode(f.ggml().expect("a GGUF format"), &self.blocks, &mut out);
                out
            }
        }
    }

    /// Bytes held on a device (GGUF: both planes; the official formats: blocks and scales, FP4's
    /// as one byte each).
    pub fn device_bytes(&self) -> u64 {
        let blocks = match self.format.planes() {
            Some(p) => self.blocks.len() / p.block_bytes * p.device_block_bytes(),
            None => self.blocks.len(),
        };
        (blocks + if self.format == PackedFormat::Fp8 { 4 } else { 1 } * self.scales.len()) as u64
    }

    /// Bytes of a `[rows, cols]` weight in `format` as stored (blocks + scales).
    pub fn bytes_of(format: PackedFormat, rows: usize, cols: usize) -> u64 {
        let scale_bytes = if format == PackedFormat::Fp8 { 4 } else { 1 };
        (rows * format.row_bytes(cols) + scale_bytes * format.n_scales(rows, cols)) as u64
    }

    /// Device bytes of a `[rows, cols]` weight in `format`: both planes of a GGUF format (IQ2_XXS
    /// 72 bytes a block against 66 stored, see [`Planes`]), else [`Self::bytes_of`].
    pub fn device_bytes_of(format: PackedFormat, rows: usize, cols: usize) -> u64 {
        match format.planes() {
            Some(p) => (rows * (cols / format.block()) * p.device_block_bytes()) as u64,
            None => Self::bytes_of(format, rows, cols),
        }
    }
}

/// IEEE f16 bits of `x` (round to nearest even), for writing block scales.
pub fn f16_bits(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant;

    #[test]
    fn sizes_match_ggml() {
        assert_eq!(PackedFormat::Q2_K.row_bytes(512), 168);
        assert_eq!(PackedFormat::IQ2_XXS.row_bytes(256), 66);
        assert_eq!(PackedFormat::Fp4.row_bytes(64), 32);
        assert_eq!(PackedFormat::Fp8.n_scales(129, 256), 4);
        assert!((PackedFormat::IQ2_XXS.bits_per_weight() - 2.0625).abs() < 1e-12);
        assert!(!PackedFormat::Q4_K.fits(128));
    }

    #[test]
    fn dequantize_is_the_loader_decoder() {
        let x: Vec<f32> = (0..512).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        let p = Packed { format: PackedFormat::Q4_K, blocks: quant::quantize_q4_k(&x), scales: vec![] };
        let mut want = vec![0f32; 512];
        quant::dequant_q4_k(&p.blocks, &mut want);
        assert_eq!(p.dequantize(2, 256), want);
    }

    #[test]
    fn planes_split_and_join_every_gguf_format() {
        for f in PackedFormat::ALL {
            let Some(pl) = f.planes() else { continue };
            assert_eq!(pl.block_bytes, f.row_bytes(f.block()), "{}", f.name());
            let blocks: Vec<u8> = (0..3 * pl.block_bytes).map(|i| (i * 37 % 251) as u8).collect();
            let (codes, heads) = pl.split(&blocks);
            assert_eq!((codes.len(), heads.len()), (3 * pl.code_len, 3 * pl.head_len()));
            if !pl.iq2_signs {
                assert_eq!(pl.head_len(), pl.block_bytes - pl.code_len);
                let code = &blocks[pl.block_bytes + pl.code_off..][..pl.code_len];
                assert_eq!(&codes[pl.code_len..2 * pl.code_len], code);
            }
            assert_eq!(pl.join(&codes, &heads).unwrap(), blocks, "{}", f.name());
        }
        assert_eq!(Packed::device_bytes_of(PackedFormat::IQ2_XXS, 2, 512), 4 * 72);
        assert_eq!(Packed::bytes_of(PackedFormat::IQ2_XXS, 2, 512), 4 * 66);
        assert_eq!(Packed::device_bytes_of(PackedFormat::Q2_K, 2, 512), 4 * 84);
    }

    /// A small deterministic generator (xorshift64*) for the tests' random blocks.
    fn rng(seed: u64) -> impl FnMut() -> u64 {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        move || {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            x.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
    }

    /// The IQ2_XXS planes decoded on the host as the kernels read them (quant.cu's `iq2_scale` and
    /// `iq2_quads`): per 32-value sub-block j the scale from head word j / 4, and value 4q + i the
    /// grid byte negated when bit `iq2_sign_bit(q, i)` of the sign word is set.
    fn iq2_planes_decode(codes: &[u8], heads: &[u8]) -> Vec<f32> {
        let mut out = Vec::new();
        for (c, h) in codes.chunks_exact(64).zip(heads.chunks_exact(8)) {
            for (j, sub) in c.chunks_exact(8).enumerate() {
                let hw = u32::from_le_bytes(h[4 * (j / 4)..][..4].try_into().unwrap());
                let d = half::f16::from_bits((hw >> 16) as u16).to_f32();
                let db = d * (0.5 + ((hw >> (4 * (j % 4))) & 15) as f32) * 0.25;
                let s = u32::from_le_bytes(sub[4..8].try_into().unwrap());
                for q in 0..8 {
                    let grid = quant::IQ2XXS_GRID[sub[q / 2] as usize].to_le_bytes();
                    for i in 0..4 {
                        let g = grid[4 * (q % 2) + i] as f32;
                        out.push(if (s >> iq2_sign_bit(q as u32, i as u32)) & 1 == 1 { -(db * g) } else { db * g });
                    }
                }
            }
        }
        out
    }

    #[test]
    fn iq2_planes_round_trip_and_decode_as_gguf() {
        let pl = PackedFormat::IQ2_XXS.planes().unwrap();
        let mut r = rng(5);
        for n in [1usize, 2, 7] {
            // Random GGUF blocks (any bytes are a valid IQ2_XXS block), d a finite f16.
            let mut blocks: Vec<u8> = (0..n * 66).map(|_| r() as u8).collect();
            for b in blocks.chunks_exact_mut(66) {
                b[..2].copy_from_slice(&f16_bits((r() % 2000) as f32 / 1000.0 - 1.0).to_le_bytes());
            }
            let (codes, heads) = pl.split(&blocks);
            assert_eq!((codes.len(), heads.len()), (64 * n, 8 * n));
            assert_eq!(pl.join(&codes, &heads).unwrap(), blocks);
            let mut want = vec![0f32; 256 * n];
            quant::dequant_iq2_xxs(&blocks, &mut want);
            let got = iq2_planes_decode(&codes, &heads);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "value {i}: planes {g}, GGUF {w}");
            }
        }
        // Every 7-bit sign pattern of every grid entry, through the sign word and back.
        for i in 0..(1u32 << 28) / 4093 {
            let aux = i * 4093 + (i & 4095);
            let aux = aux & 0x0fff_ffff;
            assert_eq!(iq2_gguf_signs(iq2_sign_word(aux)), Some(aux));
        }
    }

    #[test]
    fn iq2_join_refuses_what_gguf_cannot_hold() {
        let pl = PackedFormat::IQ2_XXS.planes().unwrap();
        let mut r = rng(9);
        let blocks: Vec<u8> = (0..2 * 66).map(|_| r() as u8).collect();
        let (codes, heads) = pl.split(&blocks);
        // Any one sign flipped leaves its grid entry with an odd number of negatives.
        for bit in 0..32 {
            let mut c = codes.clone();
            let at = 64 + 8 * 3 + 4 + bit / 8;
            c[at] ^= 1 << (bit % 8);
            let e = pl.join(&c, &heads).unwrap_err();
            assert!(e.contains("block 1 sub-block 3"), "{e}");
            // Two signs of the same grid entry flipped keep it even (a valid, different block).
            // (Values i and i + 1 mod 4 of the same quad: bits 4i + r and 4(i + 1 mod 4) + r.)
            let partner = (bit & !12) | ((bit + 4) & 12);
            c[64 + 8 * 3 + 4 + partner / 8] ^= 1 << (partner % 8);
            let j = pl.join(&c, &heads).unwrap();
            assert_ne!(j, blocks);
            assert_eq!(pl.split(&j), (c, heads.clone()));
        }
        let mut h = heads.clone();
        h[7] ^= 0x10;
        assert!(pl.join(&codes, &h).unwrap_err().contains("two copies of d"));
        assert!(pl.join(&codes[..63], &heads).is_err());
    }
}
