//! Per-sequence inference state of the CPU backend (spec §9.1), explicit field by field.

use dsv4_model::{AttnKind, Config};

/// One compressor's state: open rows of the current window, the overlap rows (A-halves of the
/// last completed window, CSA only) and the emitted entries.
#[derive(Clone, Debug, PartialEq)]
pub struct CompState {
    pub ratio: usize,
    /// Entry width (`head_dim`, or `index_head_dim` for the indexer).
    pub head: usize,
    /// CSA-style overlapping windows (projection width `2·head`).
    pub overlap: bool,
    /// Raw rows `u_p` of the open window, `[rem, width]`.
    pub open_u: Vec<f32>,
    /// Gate rows `z_p + ape[p mod m]` of the open window, `[rem, width]`.
    pub open_z: Vec<f32>,
    /// A-halves of the last completed window, `[ratio, head]`; `u = 0, z = −∞` before any.
    pub prev_u: Vec<f32>,
    pub prev_z: Vec<f32>,
    /// Emitted entries after norm and RoPE, `[n, head]`.
    pub entries: Vec<f32>,
}

impl CompState {
    pub fn new(ratio: usize, head: usize, overlap: bool) -> Self {
        let (pu, pz) = if overlap {
            (vec![0.0; ratio * head], vec![f32::NEG_INFINITY; ratio * head])
        } else {
            (Vec::new(), Vec::new())
        };
        CompState {
            ratio,
            head,
            overlap,
            open_u: Vec::new(),
            open_z: Vec::new(),
            prev_u: pu,
            prev_z: pz,
            entries: Vec::new(),
        }
    }
    /// Projection width: `2·head` with overlap, else `head`.
    pub fn width(&self) -> usize {
        if self.overlap {
            2 * self.head
        } else {
            self.head
        }
    }
    pub fn n_open(&self) -> usize {
        self.open_u.len() / self.width()
    }
    pub fn n_entries(&self) -> usize {
        self.entries.len() / self.head
    }
    pub fn entry(&self, i: usize) -> &[f32] {
        &self.entries[i * self.head..(i + 1) * self.head]
    }
}

/// One layer's state for one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerState {
    /// Window ring: KV rows at slot `pos mod cap`, `[cap, head_dim]`.
    pub ring: Vec<f32>,
    /// Position held by each slot (`usize::MAX` = empty).
    pub ring_pos: Vec<usize>,
    pub comp: Option<CompState>,
    pub index: Option<CompState>,
}

impl LayerState {
    pub fn new(cfg: &Config, layer: usize) -> Self {
        let spec = cfg.layers[layer];
        let cap = cfg.window;
        let (comp, index) = match spec.attn {
            AttnKind::Swa => (None, None),
            AttnKind::Hca => (Some(CompState::new(spec.ratio, cfg.head_dim, false)), None),
            AttnKind::Csa => (
                Some(CompState::new(spec.ratio, cfg.head_dim, true)),
                Some(CompState::new(spec.ratio, cfg.index_head_dim, true)),
            ),
        };
        LayerState { ring: vec![0.0; cap * cfg.head_dim], ring_pos: vec![usize::MAX; cap], comp, index }
    }
    pub fn cap(&self) -> usize {
        self.ring_pos.len()
    }
}

/// Every layer's state for one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqState {
    pub layers: Vec<LayerState>,
}

impl SeqState {
    pub fn new(cfg: &Config) -> Self {
        SeqState { layers: (0..cfg.n_layers()).map(|l| LayerState::new(cfg, l)).collect() }
    }
}

/// The pool of sequence states; a slot is (re)initialised by `reset_seq`.
pub struct CpuCache {
    pub seqs: Vec<Option<SeqState>>,
    cfg: Config,
}

impl CpuCache {
    pub fn new(cfg: &Config, max_seqs: usize) -> Self {
        CpuCache { seqs: (0..max_seqs).map(|_| None).collect(), cfg: cfg.clone() }
    }
    pub fn reset(&mut self, seq: usize) {
        self.seqs[seq] = Some(SeqState::new(&self.cfg));
    }
    pub fn seq(&self, seq: usize) -> &SeqState {
        self.seqs[seq].as_ref().expect("sequence slot not initialised")
    }
    pub fn seq_mut(&mut self, seq: usize) -> &mut SeqState {
        self.seqs[seq].as_mut().expect("sequence slot not initialised")
    }
    pub fn layer(&self, seq: usize, layer: usize) -> &LayerState {
        &self.seq(seq).layers[layer]
    }
    pub fn layer_mut(&mut self, seq: usize, layer: usize) -> &mut LayerState {
        &mut self.seq_mut(seq).layers[layer]
    }
}
