//! Scalar formats of DeepSeek V4 checkpoints (spec §8.5) and their dequantisation.
//!
//! FP8 E4M3 ("fn": no infinities, 0x7f/0xff are NaN), UE8M0 scales (2^(b−127), 0xff is NaN) and FP4
//! E2M1 codes packed two per byte, low nibble first.

/// E2M1 code → value; bit 3 is the sign (spec §8.5).
pub const E2M1_TABLE: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// Decodes one FP8 E4M3FN byte.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// Decodes one UE8M0 scale byte: 2^(b − 127); 0xff is NaN.
pub fn e8m0_to_f32(b: u8) -> f32 {
    if b == 0xff {
        f32::NAN
    } else {
        2f32.powi(b as i32 - 127)
    }
}

/// `W[i,j] = fp8(W[i,j]) · S[i/block, j/block]` for a `[rows, cols]` FP8 weight with block scales
/// `[ceil(rows/block), ceil(cols/block)]` (already decoded to f32).
pub fn dequant_fp8_blocks(w: &[u8], scale: &[f32], rows: usize, cols: usize, block: usize) -> Vec<f32> {
    let sc = cols.div_ceil(block);
    let mut out = vec![0f32; rows * cols];
    for i in 0..rows {
        for j in 0..cols {
            out[i * cols + j] = e4m3_to_f32(w[i * cols + j]) * scale[(i / block) * sc + j / block];
        }
    }
    out
}

/// FP4 E2M1 experts: `packed` is `[rows, cols/2]` bytes (low nibble = even column), `scale` is
/// `[rows, cols/group]` (decoded to f32), one scale per `group` consecutive input columns.
pub fn dequant_fp4(packed: &[u8], scale: &[f32], rows: usize, cols: usize, group: usize) -> Vec<f32> {
    let sg = cols.div_ceil(group);
    let mut out = vec![0f32; rows * cols];
    for i in 0..rows {
        for jp in 0..cols / 2 {
            let b = packed[i * (cols / 2) + jp];
            for (k, code) in [(0usize, b & 0x0f), (1, b >> 4)] {
                let j = 2 * jp + k;
                out[i * cols + j] = E2M1_TABLE[code as usize] * scale[i * sg + j / group];
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_known_values() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0); // largest finite
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert!(e4m3_to_f32(0x7f).is_nan());
        assert_eq!(e4m3_to_f32(0x40), 2.0);
    }

    #[test]
    fn e8m0_known_values() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(130), 8.0);
        assert_eq!(e8m0_to_f32(120), 2f32.powi(-7));
        assert!(e8m0_to_f32(255).is_nan());
    }

    #[test]
    fn fp4_low_nibble_is_even_column() {
        // one row, 4 columns: codes (1, 7) in byte 0 and (9, 0) in byte 1; scale 2.
        let packed = [0x71u8, 0x09];
        let out = dequant_fp4(&packed, &[2.0], 1, 4, 32);
        assert_eq!(out, vec![1.0, 12.0, -1.0, 0.0]);
    }

    #[test]
    fn fp8_block_scales_index_by_block() {
        // 2x3 weight, block 2: scale grid 1x2.
        let w = [0x38u8; 6];
        let out = dequant_fp8_blocks(&w, &[2.0, 4.0], 2, 3, 2);
        assert_eq!(out, vec![2.0, 2.0, 4.0, 2.0, 2.0, 4.0]);
    }
}
