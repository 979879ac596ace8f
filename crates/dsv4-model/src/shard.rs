//! Which share of the weights one rank of a tensor + expert parallel group holds.
//!
//! Rank `r` of `world` holds: the routed experts `r·E/W..(r+1)·E/W` (expert parallel); the
//! query heads, sinks and `wo_a` rows of the head groups `r·G/W..(r+1)·G/W` and the matching
//! input columns of `wo_b` (tensor parallel attention, whole `wo_a` groups per rank, spec §5.7);
//! rows `r·I/W..` of the shared expert's `w1`/`w3` and those columns of its `w2`; and the LM head
//! rows `⌊r·V/W⌋..⌊(r+1)·V/W⌋` (vocabulary shards need not be equal: the all-gather takes each
//! rank's width). Everything else (embedding, mHC, norms, the single KV head, compressors,
//! indexer, router, gate bias, `tid2eid`) is replicated. World 1 is the whole model.

use crate::config::Config;
use crate::packed::{Packed, PackedFormat, FP4_GROUP, FP8_BLOCK};
use crate::store::LoadError;
use std::ops::Range;

/// One rank's place in a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

impl Default for Shard {
    fn default() -> Self {
        Shard::WHOLE
    }
}

/// Which part of a tensor a rank keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    All,
    /// Rows (for a 1-D tensor: elements) in this range.
    Rows(Range<usize>),
    /// Columns in this range, of every row.
    Cols(Range<usize>),
}

fn even(what: &str, name: String, shape: &[usize], n: usize, world: usize) -> Result<(), LoadError> {
    if n.is_multiple_of(world) {
        return Ok(());
    }
    Err(LoadError::Value {
        name,
        msg: format!("shape {shape:?}: its {n} {what} do not split evenly over {world} ranks"),
    })
}

impl Shard {
    /// The whole model on one rank.
    pub const WHOLE: Shard = Shard { rank: 0, world: 1 };

    pub fn new(rank: usize, world: usize) -> Self {
        assert!(world > 0 && rank < world, "rank {rank} of a world of {world}");
        Shard { rank, world }
    }

    pub fn is_whole(&self) -> bool {
        self.world == 1
    }

    /// Checks that `cfg` splits over `world` ranks; the error names the first tensor (of layer
    /// 0) whose dimension does not divide, and its shape.
    pub fn check(&self, cfg: &Config) -> Result<(), LoadError> {
        let w = self.world;
        let (d, hd, og, olr) = (cfg.hidden, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank);
        let wo_a = vec![og * olr, cfg.n_heads * hd / og.max(1)];
        even("head groups (o_groups)", "layers.0.attn.wo_a.weight".into(), &wo_a, og, w)?;
        even("heads", "layers.0.attn.attn_sink".into(), &[cfg.n_heads], cfg.n_heads, w)?;
        let ne = cfg.n_routed_experts;
        even("routed experts", "layers.0.ffn.gate.weight".into(), &[ne, d], ne, w)?;
        let inter = cfg.moe_inter;
        even("shared-expert rows", "layers.0.ffn.shared_experts.w1.weight".into(), &[inter, d], inter, w)?;
        if cfg.vocab_size < w {
            return Err(LoadError::Value {
                name: "head.weight".into(),
                msg: format!("shape {:?}: fewer vocabulary rows than {w} ranks", [cfg.vocab_size, d]),
            });
        }
        Ok(())
    }

    fn split(&self, n: usize) -> Range<usize> {
        n / self.world * self.rank..n / self.world * (self.rank + 1)
    }

    /// The routed experts this rank owns (global ids).
    pub fn experts(&self, cfg: &Config) -> Range<usize> {
        self.split(cfg.n_routed_experts)
    }

    /// The LM head's vocabulary rows of rank `rank` (uneven where the world does not divide it).
    pub fn vocab_of(&self, cfg: &Config, rank: usize) -> Range<usize> {
        let v = cfg.vocab_size;
        rank * v / self.world..(rank + 1) * v / self.world
    }

    /// The configuration the forward runs with on this rank: its share of heads and head groups
    /// (the attention op and `wo_a` take their counts from it). Everything else is global.
    pub fn local_config(&self, cfg: &Config) -> Config {
        let mut c = cfg.clone();
        c.n_heads /= self.world;
        c.o_groups /= self.world;
        c
    }

    /// The part of the tensor `official` (logical shape `shape`) this rank keeps.
    pub fn part(&self, cfg: &Config, official: &str, shape: &[usize]) -> Part {
        if self.is_whole() {
            return Part::All;
        }
        let n = official.strip_prefix("model.").unwrap_or(official);
        let tail = n.split_once('.').filter(|_| n.starts_with("layers.")).map(|(_, t)| t);
        let tail = tail.and_then(|t| t.split_once('.')).map_or(n, |(_, t)| t);
        let rows = |n: usize| Part::Rows(self.split(n));
        match tail {
            "head.weight" if n == tail => Part::Rows(self.vocab_of(cfg, self.rank)),
            "attn.wq_b.weight" | "attn.wo_a.weight" | "attn.attn_sink" => rows(shape[0]),
            "attn.wo_b.weight" | "ffn.shared_experts.w2.weight" => Part::Cols(self.split(shape[1])),
            "ffn.shared_experts.w1.weight" | "ffn.shared_experts.w3.weight" => rows(shape[0]),
            _ => Part::All,
        }
    }
}

impl Part {
    /// The shape after cutting `shape` (1-D tensors are cut by element).
    pub fn shape(&self, shape: &[usize]) -> Vec<usize> {
        let mut s = shape.to_vec();
        match self {
            Part::All => {}
            Part::Rows(r) => s[0] = r.len(),
            Part::Cols(c) => s[1] = c.len(),
        }
        s
    }

    /// Cuts row-major `data` of `shape`; empty data (a dry run) stays empty.
    pub fn cut(&self, shape: &[usize], data: Vec<f32>) -> Vec<f32> {
        if data.is_empty() {
            return data;
        }
        let cols = if shape.len() == 2 { shape[1] } else { 1 };
        match self {
            Part::All => data,
            Part::Rows(r) => data[r.start * cols..r.end * cols].to_vec(),
            Part::Cols(c) => data.chunks(cols).flat_map(|row| row[c.clone()].iter().copied()).collect(),
        }
    }
}

impl Part {
    /// Cuts stored blocks without decoding them, where the cut falls on block boundaries (FP8:
    /// 128 × 128 scale blocks; FP4 and GGUF: whole blocks along a row, any rows); `None`
    /// otherwise (the caller then cuts the dequantised values). Empty blocks (a dry run) give
    /// empty blocks of the same format.
    pub fn cut_packed(&self, shape: &[usize], p: &Packed) -> Option<Packed> {
        let (rows, cols) = match shape {
            [r, c] => (*r, *c),
            _ => return None,
        };
        let f = p.format;
        let dry = p.blocks.is_empty();
        let out = |blocks: Vec<u8>, scales: Vec<f32>| Some(Packed { format: f, blocks, scales });
        // Whole units of `unit` along an axis of length `n`: the cut's ends are multiples of it
        // (or the axis end).
        let aligned = |r: &Range<usize>, unit: usize, n: usize| {
            r.start.is_multiple_of(unit) && (r.end.is_multiple_of(unit) || r.end == n)
        };
        let rb = f.row_bytes(cols);
        match (self, f) {
            (Part::All, _) => Some(p.clone()),
            (Part::Rows(r), PackedFormat::Fp8) => {
                if !aligned(r, FP8_BLOCK, rows) {
                    return None;
                }
                if dry {
                    return out(vec![], vec![]);
                }
                let sc = cols.div_ceil(FP8_BLOCK);
                let (s0, s1) = (r.start / FP8_BLOCK, r.end.div_ceil(FP8_BLOCK));
                out(p.blocks[r.start * rb..r.end * rb].to_vec(), p.scales[s0 * sc..s1 * sc].to_vec())
            }
            (Part::Rows(r), _) => {
                if dry {
                    return out(vec![], vec![]);
                }
                let ns = f.n_scales(1, cols);
                out(p.blocks[r.start * rb..r.end * rb].to_vec(), p.scales[r.start * ns..r.end * ns].to_vec())
            }
            (Part::Cols(c), PackedFormat::Fp8) => {
                if !aligned(c, FP8_BLOCK, cols) {
                    return None;
                }
                if dry {
                    return out(vec![], vec![]);
                }
                let sc = cols.div_ceil(FP8_BLOCK);
                let (s0, s1) = (c.start / FP8_BLOCK, c.end.div_ceil(FP8_BLOCK));
                let blocks = p.blocks.chunks(cols).flat_map(|row| row[c.clone()].iter().copied()).collect();
                let scales = p.scales.chunks(sc).flat_map(|row| row[s0..s1].iter().copied()).collect();
                out(blocks, scales)
            }
            (Part::Cols(c), _) => {
                let unit = if f == PackedFormat::Fp4 { FP4_GROUP } else { f.block() };
                if !c.start.is_multiple_of(unit) || !c.end.is_multiple_of(unit) {
                    return None;
                }
                if dry {
                    return out(vec![], vec![]);
                }
                let per = rb / (cols / unit); // bytes of one unit
                let (b0, b1) = (c.start / unit * per, c.end / unit * per);
                let blocks = p.blocks.chunks(rb).flat_map(|row| row[b0..b1].iter().copied()).collect();
                let ns = f.n_scales(1, cols);
                let scales = if ns == 0 {
                    vec![]
                } else {
                    let (s0, s1) = (c.start / FP4_GROUP, c.end / FP4_GROUP);
                    p.scales.chunks(ns).flat_map(|row| row[s0..s1].iter().copied()).collect()
                };
                out(blocks, scales)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_parts() {
        let cfg = crate::synth::tiny_config(97);
        let s = Shard::new(1, 2);
        assert_eq!(s.part(&cfg, "layers.3.attn.wq_b.weight", &[128, 24]), Part::Rows(64..128));
        assert_eq!(s.part(&cfg, "layers.3.attn.wo_b.weight", &[64, 32]), Part::Cols(16..32));
        assert_eq!(s.part(&cfg, "layers.3.attn.wkv.weight", &[32, 64]), Part::All);
        assert_eq!(s.part(&cfg, "layers.0.attn.indexer.wq_b.weight", &[64, 24]), Part::All);
        assert_eq!(s.part(&cfg, "head.weight", &[97, 64]), Part::Rows(48..97));
        assert_eq!(Shard::new(0, 2).part(&cfg, "head.weight", &[97, 64]), Part::Rows(0..48));
        assert_eq!(Part::Cols(1..2).cut(&[2, 3], vec![0., 1., 2., 3., 4., 5.]), vec![1., 4.]);
        assert_eq!(Part::Rows(1..2).cut(&[2, 3], vec![0., 1., 2., 3., 4., 5.]), vec![3., 4., 5.]);
    }

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (s >> 56) as u8
            })
            .collect()
    }

    /// Cutting the blocks and then decoding equals decoding and then cutting, bit for bit.
    #[test]
    fn packed_cuts_equal_dequantised_cuts() {
        let (rows, cols) = (300, 512);
        let fp8_scales = |r: usize, c: usize| (0..r.div_ceil(128) * c.div_ceil(128)).map(|i| 0.5 + i as f32).collect();
        let fp4_scales = |r: usize, c: usize| (0..r * c / 32).map(|i| (1 << (i % 4)) as f32).collect();
        // Q8_0: an f16 scale of 1.0 then 32 int8 values per block.
        let q8: Vec<u8> = (0..rows * cols / 32)
            .flat_map(|b| [0x00, 0x3c].into_iter().chain(bytes(32, b as u64)))
            .collect::<Vec<u8>>();
        let cases = [
            Packed { format: PackedFormat::Fp8, blocks: bytes(rows * cols, 1), scales: fp8_scales(rows, cols) },
            Packed { format: PackedFormat::Fp4, blocks: bytes(rows * cols / 2, 2), scales: fp4_scales(rows, cols) },
            Packed { format: PackedFormat::Q8_0, blocks: q8, scales: vec![] },
        ];
        let parts =
            [Part::Rows(128..256), Part::Rows(256..300), Part::Rows(7..9), Part::Cols(128..384), Part::Cols(384..512)];
        for p in &cases {
            let full = p.dequantize(rows, cols);
            for part in &parts {
                let shape = part.shape(&[rows, cols]);
                let Some(cut) = part.cut_packed(&[rows, cols], p) else {
                    assert!(p.format == PackedFormat::Fp8 && *part == Part::Rows(7..9), "{:?} {part:?}", p.format);
                    continue;
                };
                let got = cut.dequantize(shape[0], shape[1]);
                let want = part.cut(&[rows, cols], full.clone());
                assert!(
                    got.iter().map(|v| v.to_bits()).eq(want.iter().map(|v| v.to_bits())),
                    "{:?} {part:?}",
                    p.format
                );
            }
        }
        assert!(Part::Cols(100..200).cut_packed(&[rows, cols], &cases[0]).is_none());
    }
}
