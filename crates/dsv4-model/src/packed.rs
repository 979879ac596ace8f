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
        Some(Planes { block_bytes, code_off, code_len })
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planes {
    pub block_bytes: usize,
    /// Where the codes start in a block, and how many bytes they take.
    pub code_off: usize,
    pub code_len: usize,
}

impl Planes {
    pub fn head_len(&self) -> usize {
        self.block_bytes - self.code_len
    }

    /// (codes, heads) of whole blocks, each plane in block order.
    pub fn split(&self, blocks: &[u8]) -> (Vec<u8>, Vec<u8>) {
        assert!(blocks.len().is_multiple_of(self.block_bytes), "{} bytes are not whole blocks", blocks.len());
        let n = blocks.len() / self.block_bytes;
        let (mut codes, mut heads) = (Vec::with_capacity(n * self.code_len), Vec::with_capacity(n * self.head_len()));
        let end = self.code_off + self.code_len;
        for b in blocks.chunks_exact(self.block_bytes) {
            heads.extend_from_slice(&b[..self.code_off]);
            codes.extend_from_slice(&b[self.code_off..end]);
            heads.extend_from_slice(&b[end..]);
        }
        (codes, heads)
    }

    /// The blocks [`Self::split`] took apart.
    pub fn join(&self, codes: &[u8], heads: &[u8]) -> Vec<u8> {
        let n = codes.len() / self.code_len;
        assert!(
            codes.len() == n * self.code_len && heads.len() == n * self.head_len(),
            "planes of {} and {} bytes are not {n} blocks",
            codes.len(),
            heads.len()
        );
        let mut out = Vec::with_capacity(n * self.block_bytes);
        for (c, h) in codes.chunks_exact(self.code_len).zip(heads.chunks_exact(self.head_len())) {
            out.extend_from_slice(&h[..self.code_off]);
            out.extend_from_slice(c);
            out.extend_from_slice(&h[self.code_off..]);
        }
        out
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

    /// Bytes held (blocks and, for the official formats, scales as one byte each on a device).
    pub fn device_bytes(&self) -> u64 {
        (self.blocks.len() + if self.format == PackedFormat::Fp8 { 4 } else { 1 } * self.scales.len()) as u64
    }

    /// Device bytes of a `[rows, cols]` weight in `format` (blocks + scales).
    pub fn bytes_of(format: PackedFormat, rows: usize, cols: usize) -> u64 {
        let scale_bytes = if format == PackedFormat::Fp8 { 4 } else { 1 };
        (rows * format.row_bytes(cols) + scale_bytes * format.n_scales(rows, cols)) as u64
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
            assert_eq!(&codes[pl.code_len..2 * pl.code_len], &blocks[pl.block_bytes + pl.code_off..][..pl.code_len]);
            assert_eq!(pl.join(&codes, &heads), blocks, "{}", f.name());
        }
    }
}
