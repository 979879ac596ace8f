//! Which weights an accelerator keeps in bf16, and the rounding it applies.
//!
//! Matrix weights (`*.weight` of rank 2: projections, experts, the output head, the embedding
//! table) are stored in bf16; the router (its top-k decisions), the mHC matrices, norms, sinks,
//! position biases and biases stay f32. Matrices that arrive as FP8/FP4/GGUF blocks are kept
//! in those blocks instead ([`keeps_packed`]): their values are already exact. A CPU run whose
//! weights went through [`round_weight`] sees the same weight values as such a backend.

use dsv4_model::{HostTensor, PackedFormat};

/// Whether a backend with bf16 weights stores this tensor in bf16.
pub fn is_bf16_weight(name: &str, shape: &[usize]) -> bool {
    shape.len() == 2 && name.ends_with(".weight") && !name.ends_with(".ffn.gate.weight") && !name.contains("hc_")
}

/// Whether such a backend keeps a tensor that arrives in `format` packed: a bf16 matrix other
/// than the embedding (a gather), whose rows are whole blocks and a multiple of 8 wide (the
/// kernels' 8-value steps).
pub fn keeps_packed(name: &str, shape: &[usize], format: PackedFormat) -> bool {
    is_bf16_weight(name, shape) && !name.starts_with("embed") && format.fits(shape[1]) && shape[1].is_multiple_of(8)
}

/// The bf16 bits of `x`, rounded to nearest even (NaN stays NaN).
pub fn to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x40;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

pub fn from_bf16_bits(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// `x` rounded to the nearest bf16 value.
pub fn round_bf16(x: f32) -> f32 {
    from_bf16_bits(to_bf16_bits(x))
}

/// Gives `t` the values a bf16 backend holds: packed blocks it keeps stay as they are (exact);
/// anything else is dequantised and, where the backend stores bf16, rounded.
pub fn round_weight(t: &mut HostTensor) {
    if t.packed.as_ref().is_some_and(|p| keeps_packed(&t.name, &t.shape, p.format)) {
        return;
    }
    t.dequantize();
    if is_bf16_weight(&t.name, &t.shape) {
        t.data.iter_mut().for_each(|v| *v = round_bf16(*v));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding() {
        assert_eq!(round_bf16(1.0), 1.0);
        assert_eq!(round_bf16(1.0 + 1.0 / 512.0), 1.0); // tie to even
        assert_eq!(round_bf16(1.0 + 3.0 / 512.0), 1.0 + 4.0 / 512.0);
        assert!(round_bf16(f32::NAN).is_nan());
        assert_eq!(round_bf16(f32::INFINITY), f32::INFINITY);
        assert_eq!(round_bf16(f32::MAX), f32::INFINITY);
        assert!(is_bf16_weight("layers.0.attn.wkv.weight", &[4, 4]));
        assert!(is_bf16_weight("layers.0.ffn.experts.3.w1.weight", &[4, 4]));
        assert!(!is_bf16_weight("layers.0.ffn.gate.weight", &[4, 4]));
        assert!(!is_bf16_weight("layers.0.hc_attn_fn", &[4, 4]));
        assert!(keeps_packed("layers.0.attn.wq_a.weight", &[8, 256], PackedFormat::Q2_K));
        assert!(!keeps_packed("embed.weight", &[8, 256], PackedFormat::Q8_0));
        assert!(!keeps_packed("layers.0.attn.wq_a.weight", &[8, 128], PackedFormat::Q2_K));
        assert!(is_bf16_weight("embed.weight", &[4, 4]));
        assert!(!is_bf16_weight("layers.0.attn.kv_norm.weight", &[4]));
    }
}
