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
}
