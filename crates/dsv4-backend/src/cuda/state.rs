//! Per-sequence inference state on the device (spec §9.1), one set of buffers per layer shared by
//! all sequence slots: slot `s` owns the `s`-th block of each.

use super::{ck, CudaBackend};
use cudarc::driver::{CudaSlice, PushKernelArg};
use crate::cpu::state::SeqState;
use dsv4_model::{AttnKind, Config};

/// One compressor's state for every slot.
pub struct CompDev {
    pub ratio: usize,
    /// Entry width (`head_dim`, or `index_head_dim` for the indexer).
    pub head: usize,
    pub overlap: bool,
    /// Open-window rows `[S, ratio, width]` (u, and z + ape) at slot `pos mod ratio`.
    pub open_u: CudaSlice<f32>,
    pub open_z: CudaSlice<f32>,
    /// A-halves of the last closed window `[S, ratio, head]` (CSA only).
    pub prev_u: CudaSlice<f32>,
    pub prev_z: CudaSlice<f32>,
    /// Emitted entries `[S, cap, head]`; `cap` grows (doubling) as sequences get longer.
    pub entries: CudaSlice<f32>,
    pub cap: usize,
}

impl CompDev {
    fn new(b: &CudaBackend, slots: usize, ratio: usize, head: usize, overlap: bool) -> Self {
        let w = if overlap { 2 * head } else { head };
        let prev = if overlap { slots * ratio * head } else { 1 };
        CompDev {
            ratio,
            head,
            overlap,
            open_u: b.alloc(slots * ratio * w),
            open_z: b.alloc(slots * ratio * w),
            prev_u: b.alloc(prev),
            prev_z: b.alloc(prev),
            entries: b.alloc(slots * head),
            cap: 1,
        }
    }

    pub fn width(&self) -> usize {
        if self.overlap {
            2 * self.head
        } else {
            self.head
        }
    }

    /// Makes room for `need` entries per slot, copying what the slots hold (stream-ordered).
    pub fn reserve(&mut self, b: &CudaBackend, slots: usize, need: usize) {
        if need <= self.cap {
            return;
        }
        let cap = need.max(2 * self.cap).max(16);
        let mut e = b.alloc::<f32>(slots * cap * self.head);
        let len = (self.cap * self.head) as i64;
        let (dst, src) = ((cap * self.head) as i64, len);
        // SAFETY: slot s copies its first `cap·head` floats into the larger block.
        ck(
            unsafe {
                b.stream
                    .launch_builder(&b.k.copy_blocks)
                    .arg(&mut e)
                    .arg(&self.entries)
                    .arg(&(slots as i32))
                    .arg(&len)
                    .arg(&dst)
                    .arg(&src)
                    .launch(super::cfg1d(slots * self.cap * self.head, 256))
            },
            "copy_blocks",
        );
        self.entries = e;
        self.cap = cap;
    }
}

/// One layer's state for every slot.
pub struct LayerDev {
    /// Window ring `[S, window, head_dim]`, KV row of position p at slot `p mod window`.
    pub ring: CudaSlice<f32>,
    pub comp: Option<CompDev>,
    pub index: Option<CompDev>,
}

/// The device state of every sequence slot and layer.
pub struct CudaCache {
    pub slots: usize,
    pub window: usize,
    pub layers: Vec<LayerDev>,
    /// Nonfinite probe flags, one per probed stage of a forward (see `bf16.cu: probe_finite`).
    pub probes: CudaSlice<u32>,
}

impl CudaCache {
    pub fn new(b: &CudaBackend, cfg: &Config, slots: usize) -> Self {
        let layers = cfg
            .layers
            .iter()
            .map(|spec| {
                let (comp, index) = match spec.attn {
                    AttnKind::Swa => (None, None),
                    AttnKind::Hca => (Some(CompDev::new(b, slots, spec.ratio, cfg.head_dim, false)), None),
                    AttnKind::Csa => (
                        Some(CompDev::new(b, slots, spec.ratio, cfg.head_dim, true)),
                        Some(CompDev::new(b, slots, spec.ratio, cfg.index_head_dim, true)),
                    ),
                };
                LayerDev { ring: b.alloc(slots * cfg.window * cfg.head_dim), comp, index }
            })
            .collect();
        // 22 named stages per layer at most (CSA), plus embed and the head's three.
        let probes = ck(b.stream.alloc_zeros::<u32>(16 + 24 * cfg.layers.len()), "alloc probes");
        CudaCache { slots, window: cfg.window, layers, probes }
    }

    /// Fresh state for slot `seq`: only the overlap rows need values (`u = 0, z = −∞`); the
    /// ring, open rows and entries are read only at positions the sequence has written.
    pub fn reset(&mut self, b: &CudaBackend, seq: usize) {
        for l in &mut self.layers {
            for c in [l.comp.as_mut(), l.index.as_mut()].into_iter().flatten() {
                if c.overlap {
                    let n = c.ratio * c.head;
                    b.fill(&mut c.prev_u, seq * n, n, 0.0);
                    b.fill(&mut c.prev_z, seq * n, n, f32::NEG_INFINITY);
                }
            }
        }
    }
}

/// Device to host copy of `len` floats at `off` (synchronises).
fn dtoh(b: &CudaBackend, buf: &CudaSlice<f32>, off: usize, len: usize) -> Vec<f32> {
    if len == 0 {
        return Vec::new();
    }
    let v = ck(b.stream.clone_dtoh(&buf.slice(off..off + len)), "snapshot download");
    ck(b.stream.synchronize(), "synchronize");
    v
}

/// Host to device copy into `buf` at `off` (stream-ordered; the driver stages pageable memory
/// before returning, so `src` may be dropped afterwards).
fn htod(b: &CudaBackend, src: &[f32], buf: &mut CudaSlice<f32>, off: usize) {
    if src.is_empty() {
        return;
    }
    let mut view = buf.slice_mut(off..off + src.len());
    ck(b.stream.memcpy_htod(src, &mut view), "snapshot upload");
}

impl CudaCache {
    /// Copies slot `seq` (holding `len` tokens) into the host format of [`SeqState`]: window rows
    /// by position, open rows, overlap rows and entries. The GPU keeps no per-position history,
    /// so the saved state cannot be cut back below `len`.
    pub fn save(&self, b: &CudaBackend, cfg: &Config, seq: usize, len: usize) -> SeqState {
        let mut st = SeqState::new(cfg);
        let (w, d) = (self.window, cfg.head_dim);
        for (ld, ls) in self.layers.iter().zip(st.layers.iter_mut()) {
            let ring = dtoh(b, &ld.ring, seq * w * d, w * d);
            let cap = ls.cap();
            for p in len.saturating_sub(w)..len {
                let (g, c) = (p % w, p % cap);
                ls.ring[c * d..(c + 1) * d].copy_from_slice(&ring[g * d..(g + 1) * d]);
                ls.ring_pos[c] = p;
            }
            for (cd, cs) in [(&ld.comp, &mut ls.comp), (&ld.index, &mut ls.index)] {
                let (Some(cd), Some(cs)) = (cd.as_ref(), cs.as_mut()) else { continue };
                let (m, hw, h) = (cd.ratio, cd.width(), cd.head);
                let (rem, n) = (len % m, len / m);
                cs.open_u = dtoh(b, &cd.open_u, seq * m * hw, rem * hw);
                cs.open_z = dtoh(b, &cd.open_z, seq * m * hw, rem * hw);
                if cd.overlap {
                    cs.prev_u = dtoh(b, &cd.prev_u, seq * m * h, m * h);
                    cs.prev_z = dtoh(b, &cd.prev_z, seq * m * h, m * h);
                }
                cs.entries = dtoh(b, &cd.entries, seq * cd.cap * h, n * h);
                cs.hist_start = len;
            }
        }
        st
    }

    /// Writes a host state into slot `seq` (the inverse of [`CudaCache::save`]).
    pub fn load(&mut self, b: &CudaBackend, cfg: &Config, seq: usize, st: &SeqState, len: usize) -> bool {
        let (w, d, slots) = (self.window, cfg.head_dim, self.slots);
        if st.layers.len() != self.layers.len() {
            return false;
        }
        for (ld, ls) in self.layers.iter_mut().zip(&st.layers) {
            let cap = ls.cap();
            for p in len.saturating_sub(w)..len {
                let c = p % cap;
                if ls.ring_pos[c] != p {
                    return false;
                }
                htod(b, &ls.ring[c * d..(c + 1) * d], &mut ld.ring, (seq * w + p % w) * d);
            }
            for (cd, cs) in [(&mut ld.comp, &ls.comp), (&mut ld.index, &ls.index)] {
                let (Some(cd), Some(cs)) = (cd.as_mut(), cs.as_ref()) else { continue };
                let (m, hw, h) = (cd.ratio, cd.width(), cd.head);
                let n = len / m;
                if cs.open_u.len() != (len % m) * hw || cs.entries.len() != n * h {
                    return false;
                }
                htod(b, &cs.open_u, &mut cd.open_u, seq * m * hw);
                htod(b, &cs.open_z, &mut cd.open_z, seq * m * hw);
                if cd.overlap {
                    htod(b, &cs.prev_u, &mut cd.prev_u, seq * m * h);
                    htod(b, &cs.prev_z, &mut cd.prev_z, seq * m * h);
                }
                cd.reserve(b, slots, n);
                htod(b, &cs.entries, &mut cd.entries, seq * cd.cap * h);
            }
        }
        true
    }
}
