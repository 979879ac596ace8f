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
    /// Raw rows `(u, z + ape)` of the most recent positions, `[n, width]` each, starting at
    /// position `hist_start`: enough to rebuild the open and overlap rows after a rollback of up
    /// to [`MAX_ROLLBACK`] tokens without replaying anything.
    pub hist_u: Vec<f32>,
    pub hist_z: Vec<f32>,
    pub hist_start: usize,
}

/// How many tokens a sequence can be cut back by (speculative decoding rejects at most a draft
/// block); the window ring keeps this many rows beyond the window.
pub const MAX_ROLLBACK: usize = 16;

/// Why a sequence could not be cut back.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TruncateError {
    #[error("cannot cut a sequence of {have} tokens back to {to}: at most {max} tokens can be rolled back")]
    TooFar { have: usize, to: usize, max: usize },
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
            hist_u: Vec::new(),
            hist_z: Vec::new(),
            hist_start: 0,
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

    /// Rows of history kept: the open window and the last completed one (for the overlap rows),
    /// plus the rollback margin.
    fn hist_keep(&self) -> usize {
        (if self.overlap { 2 } else { 1 }) * self.ratio + MAX_ROLLBACK
    }

    /// Records one fed row (called by the compressor for every position, in order).
    pub fn record(&mut self, u: &[f32], z: &[f32]) {
        let w = self.width();
        self.hist_u.extend_from_slice(u);
        self.hist_z.extend_from_slice(z);
        let n = self.hist_u.len() / w;
        if n > self.hist_keep() {
            let drop = n - self.hist_keep();
            self.hist_u.drain(..drop * w);
            self.hist_z.drain(..drop * w);
            self.hist_start += drop;
        }
    }

    /// Tokens fed so far.
    pub fn fed(&self) -> usize {
        self.hist_start + self.hist_u.len() / self.width()
    }

    /// Cuts the compressor back to `len` fed tokens: drops later entries and history and rebuilds
    /// the open rows and the overlap rows from the history.
    pub fn truncate(&mut self, len: usize) -> Result<(), TruncateError> {
        let (m, w, d) = (self.ratio, self.width(), self.head);
        let have = self.fed();
        let done = len / m;
        let need_from = if self.overlap { done.saturating_sub(1) * m } else { done * m };
        if len > have || need_from < self.hist_start {
            return Err(TruncateError::TooFar { have, to: len, max: MAX_ROLLBACK });
        }
        let row = |buf: &Vec<f32>, p: usize| -> Vec<f32> {
            buf[(p - self.hist_start) * w..(p - self.hist_start + 1) * w].to_vec()
        };
        self.entries.truncate(done * d);
        self.open_u = (done * m..len).flat_map(|p| row(&self.hist_u, p)).collect();
        self.open_z = (done * m..len).flat_map(|p| row(&self.hist_z, p)).collect();
        if self.overlap {
            if done == 0 {
                self.prev_u.iter_mut().for_each(|v| *v = 0.0);
                self.prev_z.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
            } else {
                for r in 0..m {
                    let p = (done - 1) * m + r;
                    self.prev_u[r * d..(r + 1) * d].copy_from_slice(&row(&self.hist_u, p)[..d]);
                    self.prev_z[r * d..(r + 1) * d].copy_from_slice(&row(&self.hist_z, p)[..d]);
                }
            }
        }
        self.hist_u.truncate((len - self.hist_start) * w);
        self.hist_z.truncate((len - self.hist_start) * w);
        Ok(())
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
        let cap = cfg.window + MAX_ROLLBACK;
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

    /// Cuts the state holding `have` tokens back to `len` tokens (rollback without replay):
    /// window rows of later positions are dropped, compressors are rebuilt from their history.
    pub fn truncate(&mut self, have: usize, len: usize, window: usize) -> Result<(), TruncateError> {
        if len > have || have - len > MAX_ROLLBACK {
            return Err(TruncateError::TooFar { have, to: len, max: MAX_ROLLBACK });
        }
        for l in &mut self.layers {
            let cap = l.cap();
            let d = l.ring.len() / cap;
            // Every position the window needs after the cut must still be in the ring.
            debug_assert!((len.saturating_sub(window)..len).all(|p| l.ring_pos[p % cap] == p));
            for (slot, p) in l.ring_pos.iter_mut().enumerate() {
                if *p != usize::MAX && *p >= len {
                    *p = usize::MAX;
                    l.ring[slot * d..(slot + 1) * d].fill(0.0);
                }
            }
            for c in [&mut l.comp, &mut l.index].into_iter().flatten() {
                c.truncate(len)?;
            }
        }
        Ok(())
    }

    /// The state with ring slots outside the live window `[len − window, len)` cleared and the
    /// compressor history trimmed to the rows a continuation can still need (a rollback never
    /// goes below the committed length): two states that behave the same from here on are equal
    /// in this form.
    pub fn canonical(&self, len: usize, window: usize) -> SeqState {
        let mut s = self.clone();
        for l in &mut s.layers {
            for c in [&mut l.comp, &mut l.index].into_iter().flatten() {
                let done = len / c.ratio;
                let from = if c.overlap { done.saturating_sub(1) * c.ratio } else { done * c.ratio };
                if from > c.hist_start {
                    let cut = (from - c.hist_start) * c.width();
                    c.hist_u.drain(..cut.min(c.hist_u.len()));
                    c.hist_z.drain(..cut.min(c.hist_z.len()));
                    c.hist_start = from;
                }
            }
            let cap = l.cap();
            let d = l.ring.len() / cap;
            for slot in 0..cap {
                let p = l.ring_pos[slot];
                if p == usize::MAX || p >= len || p + window < len {
                    l.ring_pos[slot] = usize::MAX;
                    l.ring[slot * d..(slot + 1) * d].fill(0.0);
                }
            }
        }
        s
    }
}

/// The pool of sequence states; a slot is (re)initialised by `reset_seq`.
pub struct CpuCache {
    pub seqs: Vec<Option<SeqState>>,
    cfg: Config,
    /// Nonfinite probes of the current forward: `Some(first nonfinite row)` per probed stage.
    pub probes: Vec<Option<usize>>,
}

impl CpuCache {
    pub fn new(cfg: &Config, max_seqs: usize) -> Self {
        CpuCache { seqs: (0..max_seqs).map(|_| None).collect(), cfg: cfg.clone(), probes: Vec::new() }
    }
    pub fn window(&self) -> usize {
        self.cfg.window
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

/// Why a serialised state was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StateFormatError {
    #[error("state bytes end early")]
    Truncated,
    #[error("state does not fit this model: {0}")]
    Shape(String),
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn u64(&mut self) -> Result<u64, StateFormatError> {
        let (h, t) = self.0.split_at_checked(8).ok_or(StateFormatError::Truncated)?;
        self.0 = t;
        Ok(u64::from_le_bytes(h.try_into().expect("8 bytes")))
    }
    fn f32s(&mut self) -> Result<Vec<f32>, StateFormatError> {
        let n = self.u64()? as usize;
        let len = n.checked_mul(4).ok_or(StateFormatError::Truncated)?;
        let (h, t) = self.0.split_at_checked(len).ok_or(StateFormatError::Truncated)?;
        self.0 = t;
        Ok(h.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect())
    }
    fn usizes(&mut self) -> Result<Vec<usize>, StateFormatError> {
        let n = self.u64()? as usize;
        if n > self.0.len() / 8 {
            return Err(StateFormatError::Truncated);
        }
        (0..n).map(|_| self.u64().map(|x| x as usize)).collect()
    }
}

fn put_u64(out: &mut Vec<u8>, x: u64) {
    out.extend_from_slice(&x.to_le_bytes());
}

fn put_f32s(out: &mut Vec<u8>, v: &[f32]) {
    put_u64(out, v.len() as u64);
    out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
}

impl CompState {
    fn write(&self, out: &mut Vec<u8>) {
        for v in [&self.open_u, &self.open_z, &self.prev_u, &self.prev_z, &self.entries, &self.hist_u, &self.hist_z] {
            put_f32s(out, v);
        }
        put_u64(out, self.hist_start as u64);
    }
    fn read(&mut self, r: &mut Reader<'_>) -> Result<(), StateFormatError> {
        let (w, m, h) = (self.width(), self.ratio, self.head);
        let open_u = r.f32s()?;
        let open_z = r.f32s()?;
        let prev_u = r.f32s()?;
        let prev_z = r.f32s()?;
        let entries = r.f32s()?;
        let hist_u = r.f32s()?;
        let hist_z = r.f32s()?;
        let hist_start = r.u64()? as usize;
        let ok = hist_u.len() == hist_z.len()
            && hist_u.len() % w == 0
            && hist_u.len() / w <= self.hist_keep()
            && open_u.len() == open_z.len()
            && open_u.len() % w == 0
            && open_u.len() / w < m
            && prev_u.len() == self.prev_u.len()
            && prev_z.len() == self.prev_z.len()
            && entries.len() % h == 0;
        if !ok {
            return Err(StateFormatError::Shape("compressor rows".into()));
        }
        (self.open_u, self.open_z, self.prev_u, self.prev_z, self.entries) = (open_u, open_z, prev_u, prev_z, entries);
        (self.hist_u, self.hist_z, self.hist_start) = (hist_u, hist_z, hist_start);
        Ok(())
    }
}

impl SeqState {
    /// A self-describing little-endian encoding (disk cache); [`SeqState::from_bytes`] checks
    /// every length against the model's config.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        put_u64(&mut out, self.layers.len() as u64);
        for l in &self.layers {
            put_f32s(&mut out, &l.ring);
            put_u64(&mut out, l.ring_pos.len() as u64);
            for &p in &l.ring_pos {
                put_u64(&mut out, p as u64);
            }
            for c in [&l.comp, &l.index].into_iter().flatten() {
                c.write(&mut out);
            }
        }
        out
    }

    pub fn from_bytes(cfg: &Config, bytes: &[u8]) -> Result<SeqState, StateFormatError> {
        let mut st = SeqState::new(cfg);
        let mut r = Reader(bytes);
        if r.u64()? as usize != st.layers.len() {
            return Err(StateFormatError::Shape("layer count".into()));
        }
        for (i, l) in st.layers.iter_mut().enumerate() {
            let ring = r.f32s()?;
            let pos = r.usizes()?;
            if ring.len() != l.ring.len() || pos.len() != l.ring_pos.len() {
                return Err(StateFormatError::Shape(format!("window ring of layer {i}")));
            }
            (l.ring, l.ring_pos) = (ring, pos);
            for c in [&mut l.comp, &mut l.index].into_iter().flatten() {
                c.read(&mut r)?;
            }
        }
        if !r.0.is_empty() {
            return Err(StateFormatError::Shape("trailing bytes".into()));
        }
        Ok(st)
    }

    /// Checks that the state is one a sequence of `len` tokens can hold: every window position
    /// in its ring slot, one compressed entry per completed window, the open rows of the current
    /// one, history ending at `len`, and no NaN. A state that passes cannot make the forward
    /// index outside what it holds (a forged or mismatched snapshot is refused here, not found
    /// by an assertion in the attention).
    pub fn check(&self, cfg: &Config, len: usize) -> Result<(), StateFormatError> {
        let bad = |m: String| Err(StateFormatError::Shape(m));
        if self.layers.len() != cfg.n_layers() {
            return bad("layer count".into());
        }
        for (i, l) in self.layers.iter().enumerate() {
            let cap = l.cap();
            if cap == 0 || l.ring.len() != cap * cfg.head_dim {
                return bad(format!("window ring of layer {i}"));
            }
            if l.ring_pos.iter().any(|&p| p != usize::MAX && p >= len) {
                return bad(format!("layer {i}: window ring holds a position beyond {len} tokens"));
            }
            if let Some(p) = (len.saturating_sub(cfg.window)..len).find(|&p| l.ring_pos[p % cap] != p) {
                return bad(format!("layer {i}: window ring lacks position {p}"));
            }
            if l.ring.iter().any(|v| !v.is_finite()) {
                return bad(format!("layer {i}: non-finite window row"));
            }
            for c in [&l.comp, &l.index].into_iter().flatten() {
                let (m, w) = (c.ratio, c.width());
                let rows = c.hist_u.len() / w;
                let ok = m > 0
                    && c.n_entries() == len / m
                    && c.n_open() == len % m
                    && c.hist_start + rows == len
                    && [&c.open_u, &c.prev_u, &c.entries, &c.hist_u].iter().all(|v| v.iter().all(|x| x.is_finite()))
                    && [&c.open_z, &c.prev_z, &c.hist_z]
                        .iter()
                        .all(|v| v.iter().all(|x| !x.is_nan() && *x != f32::INFINITY));
                if !ok {
                    return bad(format!("layer {i}: compressor state does not hold {len} tokens"));
                }
            }
        }
        Ok(())
    }

    /// Bytes of memory the state holds (cache budgets).
    pub fn size_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                let c = [&l.comp, &l.index]
                    .into_iter()
                    .flatten()
                    .map(|c| {
                        c.open_u.len()
                            + c.open_z.len()
                            + c.prev_u.len()
                            + c.prev_z.len()
                            + c.entries.len()
                            + 2 * c.hist_u.len()
                    })
                    .sum::<usize>();
                4 * (l.ring.len() + c) + 8 * l.ring_pos.len()
            })
            .sum()
    }
}
