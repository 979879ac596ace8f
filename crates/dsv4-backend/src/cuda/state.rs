//! Per-sequence inference state on the device (spec §9.1), one set of buffers per layer shared by
//! all sequence slots: slot `s` owns the `s`-th block of each.
//!
//! Every per-position buffer is a ring long enough that the rows a rollback of up to
//! [`MAX_ROLLBACK`] tokens needs are never overwritten, and nothing depends on the length but the
//! rows read: the window ring holds `window + MAX_ROLLBACK` KV rows (position `p` at `p mod cap`),
//! each compressor `K = (overlap ? 2 : 1)·ratio + MAX_ROLLBACK` raw rows (`u` and `z + ape`, at
//! `p mod K`: the open window, the last closed one whose A-halves CSA pools with, and the margin),
//! and entry `i` is pooled from window `i` (the first `len / ratio` are live). A sequence of length
//! `len` reads only rows of positions `< len`, so cutting it back is bookkeeping on the host
//! ([`CudaCache::truncate`]); the forward rewrites whatever later rows it feeds again.

use super::launch::Kernel;
use super::{ck, CudaBackend};
use crate::batch::Batch;
use crate::cpu::state::{SeqState, TruncateError, MAX_ROLLBACK};
use cudarc::driver::{CudaSlice, DevicePtrMut, LaunchConfig, PinnedHostSlice};
use dsv4_model::{AttnKind, Config};

/// One compressor's state for every slot.
pub struct CompDev {
    pub ratio: usize,
    /// Entry width (`head_dim`, or `index_head_dim` for the indexer).
    pub head: usize,
    pub overlap: bool,
    /// Raw rows `[S, rows, width]`: `u`, and `z + ape`, of position `p` at slot `p mod rows`.
    pub raw_u: CudaSlice<f32>,
    pub raw_z: CudaSlice<f32>,
    /// Ring length `(overlap ? 2 : 1)·ratio + MAX_ROLLBACK`.
    pub rows: usize,
    /// Emitted entries `[S, cap, head]`; `cap` grows (doubling) as sequences get longer.
    pub entries: CudaSlice<f32>,
    pub cap: usize,
}

impl CompDev {
    fn new(b: &CudaBackend, slots: usize, ratio: usize, head: usize, overlap: bool) -> Self {
        let w = if overlap { 2 * head } else { head };
        let rows = Self::ring_rows(ratio, overlap);
        CompDev {
            ratio,
            head,
            overlap,
            raw_u: b.alloc(slots * rows * w),
            raw_z: b.alloc(slots * rows * w),
            rows,
            entries: b.alloc(slots * head),
            cap: 1,
        }
    }

    /// Raw rows kept per slot: the open window, the last closed one (overlap) and the margin.
    pub fn ring_rows(ratio: usize, overlap: bool) -> usize {
        (if overlap { 2 } else { 1 }) * ratio + MAX_ROLLBACK
    }

    pub fn width(&self) -> usize {
        if self.overlap {
            2 * self.head
        } else {
            self.head
        }
    }

    /// First position whose raw row the state of length `len` needs: its open window's, or
    /// with overlap the last closed window's.
    fn need_from(&self, len: usize) -> usize {
        let done = len / self.ratio;
        (if self.overlap { done.saturating_sub(1) } else { done }) * self.ratio
    }

    /// Makes room for `need` entries per slot, copying what the slots hold (stream-ordered).
    /// Returns whether the entries moved (recorded steps address the old buffer).
    pub fn reserve(&mut self, b: &CudaBackend, slots: usize, need: usize) -> bool {
        if need <= self.cap {
            return false;
        }
        assert!(!b.recording(), "compressed entries must be reserved before a step is recorded");
        let cap = need.max(2 * self.cap).max(16);
        let mut e = b.alloc::<f32>(slots * cap * self.head);
        let len = (self.cap * self.head) as i64;
        let (dst, src) = ((cap * self.head) as i64, len);
        // SAFETY: slot s copies its first `cap·head` floats into the larger block.
        ck(
            unsafe {
                b.stream()
                    .kernel(&b.k.copy_blocks)
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
        // The old block is freed on the main stream: after the copy, if a side branch ran it.
        b.side_fence();
        self.entries = e;
        self.cap = cap;
        true
    }
}

/// One layer's state for every slot.
pub struct LayerDev {
    /// Window ring `[S, ring_cap, head_dim]`, KV row of position p at slot `p mod ring_cap`.
    pub ring: CudaSlice<f32>,
    pub comp: Option<CompDev>,
    pub index: Option<CompDev>,
}

/// Host bookkeeping of one slot: which device rows are valid.
#[derive(Clone, Copy, Debug, Default)]
pub struct SlotMeta {
    /// One past the highest position written since the slot was reset or loaded: the rings hold
    /// every position `q < len` with `q + ring length ≥ high`.
    pub high: usize,
    /// The length the slot was loaded at (0 after a reset): rows before it were never uploaded,
    /// so the sequence cannot be cut back below it.
    pub floor: usize,
}

/// The device state of every sequence slot and layer.
pub struct CudaCache {
    pub slots: usize,
    pub window: usize,
    /// Window ring length, `window + MAX_ROLLBACK`.
    pub ring_cap: usize,
    pub layers: Vec<LayerDev>,
    pub meta: Vec<SlotMeta>,
    /// Nonfinite probe flags, one per probed stage of a forward (see `bf16.cu: probe_finite`).
    pub probes: CudaSlice<u32>,
    /// Bumped whenever a buffer that a recorded step addresses moves (entries growing).
    pub generation: u64,
    /// Page-locked host buffers snapshots download into (see [`PinnedPool`]).
    pinned: PinnedPool,
}

impl CudaCache {
    pub fn new(b: &CudaBackend, cfg: &Config, slots: usize) -> Self {
        let ring_cap = cfg.window + MAX_ROLLBACK;
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
                LayerDev { ring: b.alloc(slots * ring_cap * cfg.head_dim), comp, index }
            })
            .collect();
        // 22 named stages per layer at most (CSA), plus embed and the head's three.
        let probes = ck(b.stream().alloc_zeros::<u32>(16 + 24 * cfg.layers.len()), "alloc probes");
        CudaCache {
            slots,
            window: cfg.window,
            ring_cap,
            layers,
            meta: vec![SlotMeta::default(); slots],
            probes,
            generation: 0,
            pinned: PinnedPool::default(),
        }
    }

    /// Fresh state for slot `seq`. Nothing on the device needs values: every buffer is read only
    /// at positions the sequence has written (window 0 of an overlapping compressor has no
    /// previous window to read).
    pub fn reset(&mut self, _b: &CudaBackend, seq: usize) {
        self.meta[seq] = SlotMeta::default();
    }

    /// Allocates compressed-entry room for `tokens` positions in every slot now (entries
    /// otherwise grow by doubling as sequences get longer), so the memory a deployment needs
    /// shows up front.
    /// Also page-locks the snapshot staging pool ([`CudaCache::prewarm_staging`]).
    pub fn reserve_tokens(&mut self, b: &CudaBackend, tokens: usize) {
        for l in &mut self.layers {
            for c in [&mut l.comp, &mut l.index].into_iter().flatten() {
                if c.reserve(b, self.slots, tokens / c.ratio + 1) {
                    self.generation += 1;
                }
            }
        }
        self.prewarm_staging(b);
    }

    /// About the floats a snapshot of a `len`-token sequence downloads ([`CudaCache::save_begin`]:
    /// the window rows, each compressor's raw rows and entries), to size the staging buffers.
    fn snapshot_floats(&self, len: usize) -> usize {
        let ring_w = |l: &LayerDev| l.ring.len() / (self.slots * self.ring_cap);
        self.layers
            .iter()
            .map(|l| {
                let comp: usize = [&l.comp, &l.index]
                    .into_iter()
                    .flatten()
                    .map(|c| 2 * len.min(c.rows + c.ratio) * c.width() + len / c.ratio * c.head)
                    .sum();
                len.min(self.ring_cap) * ring_w(l) + comp
            })
            .sum()
    }

    /// Page-locks staging buffers for snapshots of sequences up to the window, one a slot
    /// (at most half of [`PINNED_KEEP`]), and two table slabs a slot, once. Page-locking while
    /// serving stalled the engine thread (on the H100, 32 q2 layers at concurrency 64: snapshots
    /// queued in 0.03 ms at the median but 6–183 ms for 15 of 264 while other threads
    /// page-locked buffers), so it is done here, at start; a snapshot that finds no buffer free
    /// waits for one in its background half ([`Staging`]).
    fn prewarm_staging(&self, b: &CudaBackend) {
        let pool = &self.pinned;
        if pool.copy.get().is_some() {
            return; // done once already (its buffers may all be in flight now)
        }
        let n = pinned_size(self.snapshot_floats(self.window));
        let count = self.slots.min(PINNED_KEEP / 2 / n);
        let t0 = std::time::Instant::now();
        let ctx = b.main_stream().context();
        // The copy stream first: a half that sees a buffer to wait for finds it.
        let _ = pool.copy.set(ck(ctx.new_stream(), "snapshot copy stream"));
        // SAFETY (both): page-locked host memory (plain, not write-combined: the host reads
        // it); a snapshot that takes a buffer or slab writes what it later reads.
        pool.lock_tables().extend(
            (0..2 * self.slots)
                .map(|_| ck(unsafe { ctx.alloc_pinned_with_flags::<f32>(TABLE_SLAB, 0) }, "snapshot table slab")),
        );
        let bufs: Vec<_> =
            (0..count).map(|_| ck(unsafe { ctx.alloc_pinned_with_flags::<f32>(n, 0) }, "snapshot staging")).collect();
        pool.add(bufs);
        tracing::info!(
            "snapshot staging: {count} buffers of {} MiB page-locked in {:.0} ms",
            (n * 4) >> 20,
            t0.elapsed().as_secs_f64() * 1e3
        );
    }

    /// Entry room for every position `batch` feeds (before a step is recorded or replayed: the
    /// recorded work cannot grow buffers).
    pub fn reserve_batch(&mut self, b: &CudaBackend, batch: &Batch) {
        for l in &mut self.layers {
            for c in [&mut l.comp, &mut l.index].into_iter().flatten() {
                let need = batch.segments.iter().map(|s| (s.pos0 + s.len) / c.ratio).max().unwrap_or(0);
                if c.reserve(b, self.slots, need) {
                    self.generation += 1;
                }
            }
        }
    }

    /// Records the positions a forward writes (called for every attention layer; idempotent).
    pub fn note_written(&mut self, batch: &Batch) {
        for s in &batch.segments {
            let m = &mut self.meta[s.seq];
            m.high = m.high.max(s.pos0 + s.len);
        }
    }

    /// Cuts slot `seq` from `have` tokens back to `len` (rollback without replay): nothing on the
    /// device changes, since the rings still hold every row a sequence of `len` tokens reads and
    /// the next forward rewrites the later ones. Refused where a row needed may be gone: more
    /// than [`MAX_ROLLBACK`] tokens below what the slot ever held since its reset (or load), or
    /// below the length it was loaded at.
    pub fn truncate(&mut self, seq: usize, have: usize, len: usize) -> Result<(), String> {
        let m = self.meta[seq];
        let high = m.high.max(have);
        if len > have || high - len > MAX_ROLLBACK {
            return Err(TruncateError::TooFar { have: high, to: len, max: MAX_ROLLBACK }.to_string());
        }
        if len < m.floor {
            return Err(format!(
                "cannot cut a sequence restored from a snapshot of {} tokens back to {len}: its earlier rows \
                 were never uploaded",
                m.floor
            ));
        }
        Ok(())
    }
}

/// Pushes the regions holding positions `from..to` of slot `seq` of a ring of `cap` rows of
/// width `w` (position p at row p mod cap): one region, or two where the span wraps, in
/// position order.
fn ring_span<'a>(
    regions: &mut Vec<(&'a CudaSlice<f32>, usize, usize)>,
    buf: &'a CudaSlice<f32>,
    seq: usize,
    cap: usize,
    w: usize,
    from: usize,
    to: usize,
) {
    debug_assert!(to.saturating_sub(from) <= cap, "a ring span longer than the ring");
    let mut p = from;
    while p < to {
        let r = p % cap;
        let n = (cap - r).min(to - p);
        regions.push((buf, (seq * cap + r) * w, n * w));
        p += n;
    }
}

/// Host to device copy into `buf` at `off` (stream-ordered; the driver stages pageable memory
/// before returning, so `src` may be dropped afterwards).
fn htod(b: &CudaBackend, src: &[f32], buf: &mut CudaSlice<f32>, off: usize) {
    if src.is_empty() {
        return;
    }
    let mut view = buf.slice_mut(off..off + src.len());
    ck(b.main_stream().memcpy_htod(src, &mut view), "snapshot upload");
}

/// Row `i` (width `w`) of a row-major buffer.
fn row(buf: &[f32], i: usize, w: usize) -> &[f32] {
    &buf[i * w..(i + 1) * w]
}

/// A pending snapshot's host half ([`CudaCache::save_begin`]): waits for its download and
/// parses it into a [`SeqState`]; it may run on another thread.
pub type PendingSave = Box<dyn FnOnce() -> SeqState + Send>;

/// Page-locked host memory for snapshots, shared with their background halves.
///
/// Staging buffers: a pending snapshot owns one from its download until it is parsed, then puts
/// it back while the pool holds at most [`PINNED_KEEP`] floats. Served at concurrency 16 and 64
/// (43 q2 layers, H200), a short prompt's snapshot held 1–5 M floats and the engine thread paid
/// ~10 ms a snapshot in `save_begin` while buffers of exact sizes, 8 kept, were page-locked and
/// freed again (both slow): sizes are now rounded up to a power of two of at least
/// [`PINNED_MIN`] floats, so a kept buffer fits later snapshots, and the smallest that fits is
/// taken. They are page-locked at start ([`CudaCache::prewarm_staging`]).
///
/// Where none is free when a snapshot begins, its background half waits for one
/// ([`Staging::take_waiting`]) and copies on the pool's own stream. It used to copy through
/// pageable memory instead, and the driver serialises pageable copies with the engine thread's
/// calls: at concurrency 64 (43 q2 layers, H200) 47 of 338 snapshots found no buffer, their
/// pageable downloads queued one behind another for up to 426 ms, and one `save_begin` on the
/// engine thread waited 386 ms behind them (the snapshot share 8.6 ms a step). The gather
/// table of such a snapshot is uploaded from a small page-locked slab (`tables`) for the same
/// reason. Pageable copies remain only for states larger than every buffer, for the
/// synchronous [`CudaCache::save`] (which must not wait on other snapshots' halves), and after
/// [`STAGING_WAIT`] without a buffer.
struct Staging<B = PinnedHostSlice<f32>> {
    bufs: std::sync::Mutex<Vec<B>>,
    /// Signalled when a buffer goes back into `bufs`.
    freed: std::sync::Condvar,
    /// The largest buffer page-locked: a state larger than it waits for none.
    largest: std::sync::atomic::AtomicUsize,
    /// Page-locked slabs of [`TABLE_SLAB`] floats for gather tables.
    tables: std::sync::Mutex<Vec<B>>,
    /// The stream the background halves copy on (created with the pool).
    copy: std::sync::OnceLock<std::sync::Arc<cudarc::driver::CudaStream>>,
}

impl<B> Default for Staging<B> {
    fn default() -> Self {
        Staging {
            bufs: Default::default(),
            freed: Default::default(),
            largest: Default::default(),
            tables: Default::default(),
            copy: Default::default(),
        }
    }
}

/// A staging buffer's length in floats (a trait so that the pool's logic is tested on plain
/// vectors where there is no GPU).
trait Floats {
    fn floats(&self) -> usize;
}

impl Floats for PinnedHostSlice<f32> {
    fn floats(&self) -> usize {
        self.len()
    }
}

type PinnedPool = std::sync::Arc<Staging>;
const PINNED_KEEP: usize = 1 << 29;
const PINNED_MIN: usize = 1 << 20;
/// Floats of a table slab: 6 a region (three u64 words), 12 regions a layer at most (the window
/// ring and each compressor's raw u and z in up to two spans, and its entries) for 56 layers.
const TABLE_SLAB: usize = 4096;
/// How long a background half waits for a staging buffer before it copies through pageable
/// memory (a bound for a pending snapshot that is never finished while holding one; a burst of
/// 64 snapshots on 32 buffers waits ~30–50 ms).
const STAGING_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

impl<B: Floats> Staging<B> {
    fn lock_bufs(&self) -> std::sync::MutexGuard<'_, Vec<B>> {
        self.bufs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_tables(&self) -> std::sync::MutexGuard<'_, Vec<B>> {
        self.tables.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds page-locked buffers (at start) and notes the largest.
    fn add(&self, new: impl IntoIterator<Item = B>) {
        let mut bufs = self.lock_bufs();
        bufs.extend(new);
        let largest = bufs.iter().map(Floats::floats).max().unwrap_or(0);
        self.largest.fetch_max(largest, std::sync::atomic::Ordering::Relaxed);
        self.freed.notify_all();
    }

    /// The smallest free buffer that holds `need` floats, if any, without waiting.
    fn take(&self, need: usize) -> Option<B> {
        let mut bufs = self.lock_bufs();
        best_fit(bufs.iter().map(Floats::floats), need).map(|i| bufs.swap_remove(i))
    }

    /// [`Staging::take`], waiting up to `wait` for other snapshots to give one back; none at
    /// once where no buffer could ever hold `need`.
    fn take_waiting(&self, need: usize, wait: std::time::Duration) -> Option<B> {
        if self.largest.load(std::sync::atomic::Ordering::Relaxed) < need {
            return None;
        }
        let deadline = std::time::Instant::now() + wait;
        let mut bufs = self.lock_bufs();
        loop {
            if let Some(i) = best_fit(bufs.iter().map(Floats::floats), need) {
                return Some(bufs.swap_remove(i));
            }
            let left = deadline.checked_duration_since(std::time::Instant::now())?;
            bufs = self.freed.wait_timeout(bufs, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// A buffer back into the pool while it holds at most [`PINNED_KEEP`] floats (else it is
    /// dropped), waking the halves waiting for one.
    fn give_back(&self, p: B) {
        let mut bufs = self.lock_bufs();
        if bufs.iter().map(Floats::floats).sum::<usize>() + p.floats() <= PINNED_KEEP {
            bufs.push(p);
            self.freed.notify_all();
        }
    }

    fn take_table(&self, need: usize) -> Option<B> {
        if need > TABLE_SLAB {
            return None;
        }
        self.lock_tables().pop()
    }
}

/// An event recorded on `s` that a host thread waits for without spinning (the snapshot halves).
fn blocking_event(s: &cudarc::driver::CudaStream) -> cudarc::driver::CudaEvent {
    ck(s.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC)), "snapshot event")
}

/// The floats a staging buffer for a snapshot of `total` floats is allocated with.
fn pinned_size(total: usize) -> usize {
    total.max(PINNED_MIN).next_power_of_two()
}

/// The index of the smallest buffer in `sizes` that holds `total` floats.
fn best_fit(sizes: impl Iterator<Item = usize>, total: usize) -> Option<usize> {
    sizes.enumerate().filter(|&(_, n)| n >= total).min_by_key(|&(_, n)| n).map(|(i, _)| i)
}

/// Page-locked memory a copy in flight reads or writes (a staging buffer, or a table slab):
/// it goes back to the pool (or is freed) only after the copy's event, whether or not the
/// snapshot was finished.
struct Download {
    done: cudarc::driver::CudaEvent,
    pinned: Option<PinnedHostSlice<f32>>,
    pool: PinnedPool,
    /// A table slab (back into `tables`), not a staging buffer.
    table: bool,
}

impl Drop for Download {
    fn drop(&mut self) {
        let Some(p) = self.pinned.take() else { return };
        if self.done.synchronize().is_err() {
            // The copy's end is unknown: leak the buffer rather than free memory it may touch.
            std::mem::forget(p);
            return;
        }
        if self.table {
            self.pool.lock_tables().push(p);
        } else {
            self.pool.give_back(p);
        }
    }
}

/// Where a snapshot's floats go in the host state, in [`CudaCache::save_begin`]'s region order:
/// each layer's window rows `lo..len`, then per compressor its raw rows `from..len` (u, then z)
/// and its `len / ratio` entries.
struct SaveLayout {
    cfg: Config,
    len: usize,
    lo: usize,
    layers: Vec<[Option<CompLayout>; 2]>,
}

#[derive(Clone, Copy)]
struct CompLayout {
    ratio: usize,
    width: usize,
    head: usize,
    overlap: bool,
    from: usize,
    hist: usize,
}

impl SaveLayout {
    /// The state the downloaded floats `flat` hold.
    fn parse(&self, flat: &[f32]) -> SeqState {
        let (len, lo, d) = (self.len, self.lo, self.cfg.head_dim);
        let mut st = SeqState::new(&self.cfg);
        let mut at = 0;
        let mut take = |n: usize| {
            at += n;
            &flat[at - n..at]
        };
        for (cl, ls) in self.layers.iter().zip(st.layers.iter_mut()) {
            let ring = take(len.saturating_sub(lo) * d);
            let cap = ls.cap();
            debug_assert!(len.saturating_sub(lo) <= cap);
            for p in lo..len {
                let c = p % cap;
                ls.ring[c * d..(c + 1) * d].copy_from_slice(row(ring, p - lo, d));
                ls.ring_pos[c] = p;
            }
            for (cd, cs) in [(&cl[0], &mut ls.comp), (&cl[1], &mut ls.index)] {
                let (Some(cd), Some(cs)) = (cd.as_ref(), cs.as_mut()) else { continue };
                let (m, w, h, from, hist) = (cd.ratio, cd.width, cd.head, cd.from, cd.hist);
                let raw_u = take((len - from) * w);
                let raw_z = take((len - from) * w);
                // Rows of positions r (from ≤ r < len).
                let rows = |buf: &[f32], r: std::ops::Range<usize>| -> Vec<f32> {
                    buf[(r.start - from) * w..(r.end - from) * w].to_vec()
                };
                let done = len / m;
                cs.open_u = rows(raw_u, done * m..len);
                cs.open_z = rows(raw_z, done * m..len);
                if cd.overlap && done > 0 {
                    for r in 0..m {
                        let p = (done - 1) * m + r - from;
                        cs.prev_u[r * h..(r + 1) * h].copy_from_slice(&row(raw_u, p, w)[..h]);
                        cs.prev_z[r * h..(r + 1) * h].copy_from_slice(&row(raw_z, p, w)[..h]);
                    }
                }
                cs.entries = take(len / m * h).to_vec();
                cs.hist_u = rows(raw_u, hist..len);
                cs.hist_z = rows(raw_z, hist..len);
                cs.hist_start = hist;
            }
        }
        debug_assert_eq!(at, flat.len(), "a snapshot's floats all parsed");
        st
    }
}

impl CudaCache {
    /// Copies slot `seq` (holding `len` tokens) into the host format of [`SeqState`]: window rows
    /// by position, open rows, overlap rows, entries, and the compressor history a rollback can
    /// still use (the raw rows the ring holds, from the oldest still valid).
    pub fn save(&self, b: &CudaBackend, cfg: &Config, seq: usize, len: usize) -> SeqState {
        // Run at once, it must not wait for a staging buffer: pending snapshots not yet finished
        // (on this thread, later) may hold them all.
        self.save_with(b, cfg, seq, len, false)()
    }

    /// [`CudaCache::save`] in two halves. Here, stream-ordered and without a synchronisation:
    /// one kernel gathers the slot's regions (their addresses in a table) into a device buffer,
    /// which is copied into a page-locked host buffer, and an event marks the copy's end; so the
    /// snapshot holds the state as of the work queued so far, whatever the stream runs next.
    /// The returned half waits for the event and parses (on any thread): the engine runs the
    /// next step meanwhile (synchronously a snapshot cost the served step 9–20 ms, PERF.md v31).
    /// Only the rows a state reads come back: a short sequence's snapshot is a few rows a layer.
    /// Where no staging buffer is free, the returned half waits for one ([`Staging`]).
    pub fn save_begin(&self, b: &CudaBackend, cfg: &Config, seq: usize, len: usize) -> PendingSave {
        self.save_with(b, cfg, seq, len, true)
    }

    fn save_with(&self, b: &CudaBackend, cfg: &Config, seq: usize, len: usize, wait: bool) -> PendingSave {
        let t_begin = std::time::Instant::now();
        let (rc, d) = (self.ring_cap, cfg.head_dim);
        let meta = self.meta[seq];
        let high = meta.high.max(len);
        // The window rows kept, and each compressor's raw rows the state reads (the open window,
        // the last closed one with overlap, the rollback history).
        let lo = high.saturating_sub(rc).max(meta.floor.saturating_sub(self.window));
        let raw_from = |cd: &CompDev| {
            let hist = high.saturating_sub(cd.rows).max(meta.floor).min(len);
            (hist.min(cd.need_from(len)), hist)
        };
        // Every region (window ring; per compressor raw u, raw z, entries), in SaveLayout's order.
        let mut regions = Vec::new();
        let mut layout = SaveLayout { cfg: cfg.clone(), len, lo, layers: Vec::with_capacity(self.layers.len()) };
        for ld in &self.layers {
            ring_span(&mut regions, &ld.ring, seq, rc, d, lo, len);
            let mut cl = [None, None];
            for (i, cd) in [&ld.comp, &ld.index].into_iter().enumerate() {
                let Some(cd) = cd.as_ref() else { continue };
                let (w, k) = (cd.width(), cd.rows);
                let (from, hist) = raw_from(cd);
                ring_span(&mut regions, &cd.raw_u, seq, k, w, from, len);
                ring_span(&mut regions, &cd.raw_z, seq, k, w, from, len);
                regions.push((&cd.entries, seq * cd.cap * cd.head, len / cd.ratio * cd.head));
                cl[i] = Some(CompLayout { ratio: cd.ratio, width: w, head: cd.head, overlap: cd.overlap, from, hist });
            }
            layout.layers.push(cl);
        }
        let regions: Vec<_> = regions.into_iter().filter(|r| r.2 > 0).collect();
        let total: usize = regions.iter().map(|r| r.2).sum();
        if total == 0 {
            return Box::new(move || layout.parse(&[]));
        }
        let mut table = Vec::with_capacity(3 * regions.len());
        let mut at = 0;
        for &(buf, off, n) in &regions {
            debug_assert!(off + n <= buf.len(), "a snapshot region past its buffer");
            table.extend([b.dev_ptr(buf) + (off * std::mem::size_of::<f32>()) as u64, n as u64, at as u64]);
            at += n;
        }
        // The table rides in the staging buffer, past the state (8-byte aligned), or without one
        // in a table slab, so its upload is a page-locked copy: a pageable one waited behind the
        // background halves' pageable downloads (H100, 32 q2 layers at concurrency 64: three
        // snapshots queued in 13–227 ms).
        let pool = self.pinned.clone();
        let t0 = total.next_multiple_of(2);
        let mut found = pool.take(t0 + 2 * table.len());
        let mut slab = if found.is_none() { pool.take_table(2 * table.len()) } else { None };
        let staged = match (found.as_mut(), slab.as_mut()) {
            (Some(p), _) => Some((p, t0)),
            (None, Some(p)) => Some((p, 0)),
            (None, None) => None,
        };
        let table = match staged {
            Some((pinned, at)) => {
                let host = ck(pinned.as_mut_slice(), "snapshot staging");
                let words = &mut host[at..at + 2 * table.len()];
                for (w, &v) in words.chunks_exact_mut(2).zip(&table) {
                    w[0] = f32::from_bits(v as u32);
                    w[1] = f32::from_bits((v >> 32) as u32);
                }
                let mut dev = b.alloc::<u64>(table.len());
                // `dev` holds the table's u64 values, the source the same bytes of page-locked
                // memory this snapshot owns, written above and not again until the snapshot's
                // event has passed (the buffer or slab returns to the pool only after it).
                {
                    let (p, _written) = dev.device_ptr_mut(b.main_stream());
                    ck(
                        // SAFETY: as above.
                        unsafe { cudarc::driver::result::memcpy_htod_async(p, words, b.main_stream().cu_stream()) },
                        "snapshot table",
                    );
                }
                dev
            }
            None => ck(b.main_stream().clone_htod(&table), "snapshot table"),
        };
        let mut flat = b.alloc::<f32>(total);
        // SAFETY: each table row addresses `n` floats inside a live buffer (the regions are
        // rows of this cache's slots) and a distinct range of `flat`, which holds `total`.
        ck(
            unsafe {
                b.main_stream().kernel(&b.k.gather_regions).arg(&mut flat).arg(&table).launch(LaunchConfig {
                    grid_dim: (regions.len() as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
            },
            "gather_regions",
        );
        let regions = regions.len();
        let Some(mut pinned) = found else {
            // No staging buffer free (all in flight, none page-locked, or a state larger than
            // any): the background half copies `flat` once the gather is done, into a buffer
            // another snapshot gives back, or through pageable memory.
            let tab = Download { done: blocking_event(b.main_stream()), pinned: slab, pool: pool.clone(), table: true };
            drop(table);
            let (src, ctx) = (b.dev_ptr(&flat), b.main_stream().context().clone());
            tracing::debug!("snapshot queued (no staging buffer) in {:.2} ms", t_begin.elapsed().as_secs_f64() * 1e3);
            return Box::new(move || {
                let t0 = std::time::Instant::now();
                ck(tab.done.synchronize(), "snapshot wait");
                drop(tab);
                let buf = if wait { pool.take_waiting(total, STAGING_WAIT) } else { None };
                let t_wait = t0.elapsed();
                let (st, how, t_copy) = match (buf, pool.copy.get()) {
                    (Some(mut p), Some(copy)) => {
                        let host = ck(p.as_mut_slice(), "snapshot staging");
                        // SAFETY: `flat` (alive until after the copy's event) holds `total`
                        // floats, written by the gather whose event has passed; the destination
                        // is page-locked memory of at least `total` that this half owns.
                        ck(
                            unsafe {
                                cudarc::driver::result::memcpy_dtoh_async(&mut host[..total], src, copy.cu_stream())
                            },
                            "snapshot download",
                        );
                        let done = blocking_event(copy);
                        let dl = Download { done, pinned: Some(p), pool: pool.clone(), table: false };
                        ck(dl.done.synchronize(), "snapshot download");
                        drop(flat);
                        let t_copy = t0.elapsed();
                        let host = ck(dl.pinned.as_ref().expect("held until dropped").as_slice(), "snapshot staging");
                        (layout.parse(&host[..total]), "staged after a wait", t_copy)
                    }
                    (buf, _) => {
                        drop(buf);
                        let copy = ck(ctx.new_stream(), "snapshot stream");
                        let host = ck(copy.clone_dtoh(&flat), "snapshot download");
                        ck(copy.synchronize(), "snapshot download");
                        drop(flat);
                        let t_copy = t0.elapsed();
                        (layout.parse(&host[..total]), "pageable", t_copy)
                    }
                };
                tracing::debug!(
                    "snapshot of {} tokens: {regions} regions, {total} floats; download {:.2} ms ({how}, {:.2} ms of it waiting), host {:.2} ms",
                    layout.len,
                    t_copy.as_secs_f64() * 1e3,
                    t_wait.as_secs_f64() * 1e3,
                    (t0.elapsed() - t_copy).as_secs_f64() * 1e3
                );
                st
            });
        };
        let host = ck(pinned.as_mut_slice(), "snapshot staging");
        // SAFETY: `flat` holds `total` floats; the destination is page-locked host memory of at
        // least `total`, owned by the returned half, which reads it only after the event below.
        ck(
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut host[..total],
                    b.dev_ptr(&flat),
                    b.main_stream().cu_stream(),
                )
            },
            "snapshot download",
        );
        let done = blocking_event(b.main_stream());
        // `table` and `flat` are freed in stream order, after the gather and the copy.
        drop((table, flat));
        let dl = Download { done, pinned: Some(pinned), pool, table: false };
        tracing::debug!("snapshot queued in {:.2} ms", t_begin.elapsed().as_secs_f64() * 1e3);
        Box::new(move || {
            let t0 = std::time::Instant::now();
            ck(dl.done.synchronize(), "snapshot wait");
            let t_wait = t0.elapsed();
            let host = ck(dl.pinned.as_ref().expect("held until dropped").as_slice(), "snapshot staging");
            let st = layout.parse(&host[..total]);
            // The phases of a snapshot (bench_serve's `snapshot` share), for RUST_LOG.
            tracing::debug!(
                "snapshot of {} tokens: {regions} regions, {total} floats; download {:.2} ms, host {:.2} ms",
                layout.len,
                t_wait.as_secs_f64() * 1e3,
                (t0.elapsed() - t_wait).as_secs_f64() * 1e3
            );
            st
        })
    }

    /// Writes a host state of `len` tokens into slot `seq` (the inverse of [`CudaCache::save`]):
    /// the window rows, the open rows and the overlap rows' A-halves (all a continuation reads)
    /// and the entries. The slot cannot be cut back below `len` afterwards.
    pub fn load(&mut self, b: &CudaBackend, cfg: &Config, seq: usize, st: &SeqState, len: usize) -> bool {
        let (w, d, slots, rc) = (self.window, cfg.head_dim, self.slots, self.ring_cap);
        if st.layers.len() != self.layers.len() {
            return false;
        }
        // Check everything before writing anything.
        for (ld, ls) in self.layers.iter().zip(&st.layers) {
            let cap = ls.cap();
            if ls.ring.len() != cap * d || (len.saturating_sub(w)..len).any(|p| ls.ring_pos[p % cap] != p) {
                return false;
            }
            for (cd, cs) in [(&ld.comp, &ls.comp), (&ld.index, &ls.index)] {
                let (Some(cd), Some(cs)) = (cd.as_ref(), cs.as_ref()) else {
                    if cd.is_some() != cs.is_some() {
                        return false;
                    }
                    continue;
                };
                let (m, hw, h) = (cd.ratio, cd.width(), cd.head);
                let prev = if cd.overlap { m * h } else { 0 };
                if cs.ratio != m
                    || cs.open_u.len() != (len % m) * hw
                    || cs.open_z.len() != cs.open_u.len()
                    || cs.prev_u.len() != prev
                    || cs.prev_z.len() != prev
                    || cs.entries.len() != len / m * h
                {
                    return false;
                }
            }
        }
        let mut moved = false;
        for (ld, ls) in self.layers.iter_mut().zip(&st.layers) {
            let cap = ls.cap();
            let mut ring = vec![0.0f32; rc * d];
            for p in len.saturating_sub(w)..len {
                let c = p % cap;
                ring[(p % rc) * d..(p % rc + 1) * d].copy_from_slice(&ls.ring[c * d..(c + 1) * d]);
            }
            htod(b, &ring, &mut ld.ring, seq * rc * d);
            for (cd, cs) in [(&mut ld.comp, &ls.comp), (&mut ld.index, &ls.index)] {
                let (Some(cd), Some(cs)) = (cd.as_mut(), cs.as_ref()) else { continue };
                let (m, hw, h, k) = (cd.ratio, cd.width(), cd.head, cd.rows);
                let done = len / m;
                let mut raw_u = vec![0.0f32; k * hw];
                let mut raw_z = vec![0.0f32; k * hw];
                if cd.overlap && done > 0 {
                    for r in 0..m {
                        let s = ((done - 1) * m + r) % k;
                        raw_u[s * hw..s * hw + h].copy_from_slice(row(&cs.prev_u, r, h));
                        raw_z[s * hw..s * hw + h].copy_from_slice(row(&cs.prev_z, r, h));
                    }
                }
                for i in 0..len % m {
                    let s = (done * m + i) % k;
                    raw_u[s * hw..(s + 1) * hw].copy_from_slice(row(&cs.open_u, i, hw));
                    raw_z[s * hw..(s + 1) * hw].copy_from_slice(row(&cs.open_z, i, hw));
                }
                debug_assert!(cd.need_from(len) + k > len);
                htod(b, &raw_u, &mut cd.raw_u, seq * k * hw);
                htod(b, &raw_z, &mut cd.raw_z, seq * k * hw);
                moved |= cd.reserve(b, slots, done);
                htod(b, &cs.entries, &mut cd.entries, seq * cd.cap * h);
            }
        }
        self.generation += moved as u64;
        self.meta[seq] = SlotMeta { high: len, floor: len };
        true
    }
}

#[cfg(test)]
mod tests {
    use super::{best_fit, pinned_size, Floats, Staging, PINNED_KEEP, PINNED_MIN};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    impl Floats for Vec<f32> {
        fn floats(&self) -> usize {
            self.len()
        }
    }

    /// The staging pool's logic on plain vectors: a half waits for a buffer another gives back,
    /// never for one that no buffer could hold, and not past its bound.
    #[test]
    fn a_staging_wait_ends_when_a_buffer_comes_back_and_not_for_one_too_small() {
        let pool: Arc<Staging<Vec<f32>>> = Arc::default();
        assert!(pool.take_waiting(1, Duration::from_secs(5)).is_none(), "no buffer page-locked: no wait");
        pool.add([vec![0.0; 16], vec![0.0; 64]]);
        let t0 = Instant::now();
        assert!(pool.take_waiting(65, Duration::from_secs(5)).is_none(), "larger than every buffer");
        assert!(t0.elapsed() < Duration::from_secs(1), "returned at once");
        let a = pool.take(10).expect("the smallest that fits");
        assert_eq!(a.len(), 16);
        let b = pool.take_waiting(10, Duration::from_secs(5)).expect("the other one fits too");
        assert_eq!(b.len(), 64);
        // Both out: a bounded wait without a return ends empty.
        assert!(pool.take_waiting(10, Duration::from_millis(20)).is_none());
        // A waiter wakes when another thread gives one back.
        let giver = {
            let pool = pool.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                pool.give_back(a);
            })
        };
        let t0 = Instant::now();
        let got = pool.take_waiting(10, Duration::from_secs(30)).expect("given back");
        assert_eq!(got.len(), 16);
        assert!(t0.elapsed() < Duration::from_secs(10), "woken by the return, not the bound");
        giver.join().unwrap();
        // The pool keeps at most PINNED_KEEP floats.
        pool.give_back(b);
        pool.give_back(got);
        pool.give_back(vec![0.0; PINNED_KEEP]);
        assert_eq!(pool.lock_bufs().len(), 2);
    }

    #[test]
    fn staging_buffers_are_reusable_sizes_and_the_smallest_fit_is_taken() {
        assert_eq!(pinned_size(3), PINNED_MIN);
        assert_eq!(pinned_size(PINNED_MIN + 1), 2 * PINNED_MIN);
        assert_eq!(pinned_size(5_410_560), 8 << 20);
        let sizes = [4 << 20, 1 << 20, 8 << 20, 2 << 20];
        assert_eq!(best_fit(sizes.into_iter(), 1_500_000), Some(3));
        assert_eq!(best_fit(sizes.into_iter(), 5_000_000), Some(2));
        assert_eq!(best_fit(sizes.into_iter(), 9 << 20), None);
    }
}
