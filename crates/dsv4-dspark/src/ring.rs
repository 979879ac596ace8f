//! The per-sequence drafter state: one context ring per stage (spec §3.3, §7.2).

use dsv4_backend::cpu::Tensor;

/// The host ring of the CPU drafter (`Drafter<CpuBackend>`).
pub type ContextRing = Ring<Tensor>;

/// Per-sequence drafter state: for every stage a ring of `window` context K/V rows
/// (`RoPE_pos(kv_norm_s(wkv_s · main_x[pos]))`, slot `pos mod window`), plus the absolute
/// position each slot holds (`None`: empty). All stages are written together, so one tag array
/// serves them all.
///
/// Only committed positions may be written (never block rows, never rejected verify rows).
/// A draft at context position `P` reads exactly the slots tagged `P+1-window ..= P`, so holes
/// (skipped writes, truncation) are masked instead of read stale.
///
/// `T` is the backend's activation type: each stage's ring is one `[window, width]` tensor where
/// the drafter's backend keeps it (host memory for the CPU, device memory for a GPU); the tags
/// are always on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct Ring<T> {
    window: usize,
    width: usize,
    /// `[stages]` tensors `[window, width]`.
    rows: Vec<T>,
    tags: Vec<Option<usize>>,
}

impl ContextRing {
    pub fn new(stages: usize, window: usize, width: usize) -> Self {
        let rows = (0..stages).map(|_| Tensor::new(window, width, vec![0.0; window * width])).collect();
        Ring { window, width, rows, tags: vec![None; window] }
    }

    /// Writes the rows of position `pos` (one per stage, each `width` wide) into slot `pos mod window`.
    pub fn write(&mut self, pos: usize, stage_rows: &[&[f32]]) {
        assert_eq!(stage_rows.len(), self.rows.len(), "one row per stage");
        let slot = pos % self.window;
        for (ring, row) in self.rows.iter_mut().zip(stage_rows) {
            assert_eq!(row.len(), self.width, "ring row width");
            ring.data[slot * self.width..(slot + 1) * self.width].copy_from_slice(row);
        }
        self.tags[slot] = Some(pos);
    }

    /// Stage `s`'s ring, `[window, width]` (slots in slot order; check [`Self::tags`]).
    pub fn stage(&self, s: usize) -> &[f32] {
        &self.rows[s].data
    }

    pub fn row(&self, stage: usize, slot: usize) -> &[f32] {
        &self.rows[stage].data[slot * self.width..(slot + 1) * self.width]
    }
}

impl<T> Ring<T> {
    /// A ring over per-stage tensors `[window, width]` that hold no committed row yet.
    pub fn from_stages(rows: Vec<T>, window: usize, width: usize) -> Self {
        Ring { window, width, rows, tags: vec![None; window] }
    }

    /// Stage `s`'s ring tensor.
    pub fn stage_tensor(&self, s: usize) -> &T {
        &self.rows[s]
    }

    /// Stage `s`'s ring tensor, to write committed rows into (then [`Self::set_tag`]).
    pub fn stage_tensor_mut(&mut self, s: usize) -> &mut T {
        &mut self.rows[s]
    }

    /// Records that slot `pos mod window` now holds position `pos` in every stage.
    pub fn set_tag(&mut self, pos: usize) {
        self.tags[pos % self.window] = Some(pos);
    }

    /// Replaces every tag (a mirror of another ring's bookkeeping).
    pub fn set_tags(&mut self, tags: &[Option<usize>]) {
        assert_eq!(tags.len(), self.window, "one tag per slot");
        self.tags.copy_from_slice(tags);
    }

    pub fn window(&self) -> usize {
        self.window
    }

    /// Width of one row (the target's `head_dim`).
    pub fn width(&self) -> usize {
        self.width
    }

    pub fn n_stages(&self) -> usize {
        self.rows.len()
    }

    /// Forgets every row at a position `>= len` (the sequence was cut back to `len` tokens).
    /// Rows that those positions overwrote are gone too; drafts then see fewer context rows
    /// until new rows are committed.
    pub fn truncate(&mut self, len: usize) {
        for t in &mut self.tags {
            if t.is_some_and(|p| p >= len) {
                *t = None;
            }
        }
    }

    /// Empties the ring (a fresh sequence).
    pub fn clear(&mut self) {
        self.tags.iter_mut().for_each(|t| *t = None);
    }

    /// The position held by each slot.
    pub fn tags(&self) -> &[Option<usize>] {
        &self.tags
    }

    /// Whether the row of `pos` is present.
    pub fn holds(&self, pos: usize) -> bool {
        self.tags[pos % self.window] == Some(pos)
    }

    /// The highest position held, if any.
    pub fn last_pos(&self) -> Option<usize> {
        self.tags.iter().flatten().copied().max()
    }

    /// Slots a draft at context position `p` attends to, in slot order (as the reference's
    /// index list `0..min(W, P+1)` when every committed row was written).
    pub fn visible(&self, p: usize) -> Vec<usize> {
        let lo = (p + 1).saturating_sub(self.window);
        (0..self.window).filter(|&s| self.tags[s].is_some_and(|q| q >= lo && q <= p)).collect()
    }
}
