//! Which weights an accelerator keeps in bf16, and the rounding it applies.
//!
//! Matrix weights that feed a dense product (`*.weight` of rank 2: projections, experts, the
//! output head) are stored in bf16; the embedding table (a gather), the router (its top-k
//! decisions), the mHC matrices, norms, sinks, position biases and biases stay f32. A CPU run
//! whose weights went through [`round_weight`] sees the same weight values as such a backend.

use dsv4_model::HostTensor;

/// Whether a backend with bf16 weights stores this tensor in bf16.
pub fn is_bf16_weight(name: &str, shape: &[usize]) -> bool {
    shape.len() == 2
        && name.ends_with(".weight")
        && !name.starts_with("embed")
        && !name.ends_with(".ffn.gate.weight")
        && !name.contains("hc_")
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

/// Rounds `t` to bf16 in place when a bf16 backend would store it so.
pub fn round_weight(t: &mut HostTensor) {
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
        assert!(!is_bf16_weight("embed.weight", &[4, 4]));
        assert!(!is_bf16_weight("layers.0.attn.kv_norm.weight", &[4]));
    }
}
