//! Per-sequence inference state on the device (spec §9.1), one set of buffers per layer shared by
//! all sequence slots: slot `s` owns the `s`-th block of each.

use super::{ck, CudaBackend};
use cudarc::driver::{CudaSlice, PushKernelArg};
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
