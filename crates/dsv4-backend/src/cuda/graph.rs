//! Recorded steps (CUDA graphs): a forward of `rows` rows with `out` output rows is captured
//! once and replayed for every later step of that shape (decode and speculative verify steps).
//!
//! What makes a forward replayable:
//! - its inputs live in buffers that outlast it: the row table and the output-row indices
//!   ([`StepIo::dev`]) are written by one stream-ordered copy from pinned memory before each
//!   launch ([`CudaBackend::stage`]), never by the host while queued work may read them;
//! - nothing it launches depends on host data but the shape: hash routes are looked up on the
//!   device, the indexer's grids are sized by the entry capacity, per-row lengths are read from
//!   the row table;
//! - the cache buffers it addresses do not move: entries are reserved before recording and
//!   replaying ([`CudaCache::reserve_batch`]); a move bumps [`CudaCache::generation`], and a
//!   graph recorded under another generation is recorded again;
//! - every buffer it allocates is freed inside it (graph memory nodes: the driver keeps that
//!   memory mapped between replays, so a replay allocates nothing), and its logits are copied
//!   into the step's own output buffer with a nonfinite flag beside them.

use super::draw::{draw_into, draw_table};
use super::state::CudaCache;
use super::{ck, CudaBackend, CudaTensor};
use crate::backend::StepResult;
use crate::batch::Batch;
use crate::draw::{Draw, DRAW_WORDS};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, PinnedHostSlice};
use std::collections::HashMap;
use std::sync::Arc;

/// The largest step recorded (issue 11's largest row bucket): a batch-16 verify of 1 + 4 rows is
/// 80, a batch-32 one of 1 + 3 is 128. Larger steps are prefill chunks, whose kernels are bound
/// by arithmetic rather than launches, and whose shapes rarely repeat.
pub const GRAPH_MAX_ROWS: usize = 128;

/// The most rows a step may hold and still record, for routed experts of width `d` and
/// intermediate width `inter`: [`GRAPH_MAX_ROWS`] where the experts need no host
/// synchronisation up to it (the grouped kernels, which fast mode runs up to
/// [`super::bf16::grouped_max_rows`] rows and exact mode at any count; the tensor-core tiles,
/// which read the expert offsets on the device, wherever the shapes fit them), else the grouped
/// kernels' rows (above them the MoE reads expert offsets back, which a capture cannot hold: the
/// recording would fail and turn recorded steps off).
pub fn graph_max_rows(exact: bool, d: usize, inter: usize) -> usize {
    let grouped = d.is_multiple_of(8) && inter.is_multiple_of(8);
    if (exact && grouped) || super::gemm::experts_fit(d, inter) {
        GRAPH_MAX_ROWS
    } else {
        super::bf16::grouped_max_rows()
    }
}

/// Writes `batch`'s row table into `v` (`6·n` u32) in the layout of `common.cuh`: sequence,
/// position, token, segment start, segment first position, segment length.
pub(crate) fn row_table(batch: &Batch, v: &mut [u32]) {
    let n = batch.len();
    for s in &batch.segments {
        for i in s.start..s.start + s.len {
            let r = batch.rows[i];
            v[i] = r.seq as u32;
            v[n + i] = r.pos as u32;
            v[2 * n + i] = r.token;
            v[3 * n + i] = s.start as u32;
            v[4 * n + i] = s.pos0 as u32;
            v[5 * n + i] = s.len as u32;
        }
    }
}

/// One step shape's persistent buffers.
pub(crate) struct StepIo {
    /// Staging for the inputs; its own event makes a rewrite wait for the last copy out of it.
    host: PinnedHostSlice<u32>,
    /// The row table (`6·rows`), the output rows (`out`), then each output row's draw
    /// (`DRAW_WORDS·out`, `draw.cu`'s layout).
    pub(crate) dev: Arc<CudaSlice<u32>>,
    /// The logits `[out, cols]` the replay writes.
    logits: CudaSlice<f32>,
    /// Each output row's token under its draw (what crosses to the host when no logits do).
    ids: CudaSlice<u32>,
    /// The tapped stream means `[rows, hidden_cols]` (DSpark's `main_hidden`).
    hidden: CudaSlice<f32>,
    /// `0xffffffff − first nonfinite output row`, or 0.
    flag: CudaSlice<u32>,
}

/// Recorded-step state of a backend.
#[derive(Default)]
pub struct Steps {
    io: HashMap<Shape, StepIo>,
    /// The shape being recorded: `rows()` and `select_rows()` then hand out its buffers.
    recording: Option<Shape>,
}

/// A step's shape: rows, output rows, tapped hidden columns.
type Shape = (usize, usize, usize);

/// A recorded step.
pub struct StepGraph {
    graph: CudaGraph,
    key: Shape,
    /// Its kernel nodes: the launches one replay makes.
    pub(crate) kernels: usize,
}

/// The kernel nodes of a captured graph (0 if the driver cannot list them).
fn kernel_nodes(g: &CudaGraph) -> usize {
    use cudarc::driver::sys;
    let graph = g.cu_graph();
    let mut n = 0usize;
    // SAFETY: `graph` is a live graph owned by `g`; the first call only reads the node count,
    // the second fills a buffer of exactly that many handles, and each handle is only queried.
    unsafe {
        if sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) != sys::CUresult::CUDA_SUCCESS {
            return 0;
        }
        let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
        if sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) != sys::CUresult::CUDA_SUCCESS {
            return 0;
        }
        nodes
            .iter()
            .take(n)
            .filter(|&&node| {
                let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
                sys::cuGraphNodeGetType(node, &mut t) == sys::CUresult::CUDA_SUCCESS
                    && t == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL
            })
            .count()
    }
}

// SAFETY: a graph is used by one thread at a time: the model that owns it runs its steps on
// whichever thread owns the model (the engine's), and launching needs `&Model`'s backend.
unsafe impl Send for StepGraph {}
// SAFETY: as above; `&StepGraph` is only used to launch, under the model's `&mut` borrow.
unsafe impl Sync for StepGraph {}

impl CudaBackend {
    pub(crate) fn recording(&self) -> bool {
        self.steps.lock().unwrap().recording.is_some()
    }

    /// The recorded step's row table when a forward of `n` rows is being recorded.
    pub(crate) fn recorded_rows(&self, n: usize) -> Option<Arc<CudaSlice<u32>>> {
        let st = self.steps.lock().unwrap();
        let key = st.recording.filter(|k| k.0 == n)?;
        Some(st.io[&key].dev.clone())
    }

    /// The recorded step's whole input buffer and where its `out` output rows start in it.
    pub(crate) fn recorded_out_rows(&self, out: usize) -> Option<(Arc<CudaSlice<u32>>, usize)> {
        let st = self.steps.lock().unwrap();
        let key = st.recording.filter(|k| k.1 == out)?;
        Some((st.io[&key].dev.clone(), 6 * key.0))
    }

    /// Copies a step's inputs into its persistent buffers (one stream-ordered copy).
    pub(crate) fn stage(&self, batch: &Batch, out_rows: &[usize], draws: &[Draw], cols: usize, hidden_cols: usize) {
        let (n, no) = (batch.len(), out_rows.len());
        let len = 6 * n + no + DRAW_WORDS * no;
        let mut st = self.steps.lock().unwrap();
        let io = st.io.entry((n, no, hidden_cols)).or_insert_with(|| StepIo {
            // SAFETY: written below before any copy reads it.
            host: ck(unsafe { self.ctx.alloc_pinned::<u32>(len) }, "pin step inputs"),
            dev: Arc::new(self.alloc::<u32>(len)),
            logits: self.alloc::<f32>(no * cols),
            ids: self.alloc::<u32>(no),
            hidden: self.alloc::<f32>(n * hidden_cols),
            flag: ck(self.main_stream().alloc_zeros::<u32>(1), "alloc step flag"),
        });
        // Waits for the previous copy out of the staging buffer (long done: its step's output
        // was read back).
        let v = ck(io.host.as_mut_slice(), "step staging");
        row_table(batch, &mut v[..6 * n]);
        for (d, &r) in v[6 * n..6 * n + no].iter_mut().zip(out_rows) {
            *d = r as u32;
        }
        draw_table(draws, &mut v[6 * n + no..len]);
        let dev = Arc::get_mut(&mut io.dev).expect("a step's inputs are staged while no forward holds them");
        ck(self.main_stream().memcpy_htod(&io.host, dev), "stage step inputs");
    }

    pub(crate) fn begin_record(&self, rows: usize, out: usize, hidden_cols: usize) -> bool {
        let mut st = self.steps.lock().unwrap();
        if st.recording.is_some() || !st.io.contains_key(&(rows, out, hidden_cols)) {
            return false;
        }
        if let Err(e) = self.main_stream().begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) {
            tracing::warn!("CUDA graph capture could not start: {e:?}");
            return false;
        }
        st.recording = Some((rows, out, hidden_cols));
        true
    }

    /// Ends the recording: the logits go to the step's output buffer and are checked for
    /// nonfinite values there, their row argmax beside them; the tapped stream means go to the
    /// step's hidden buffer. `logits` and `hidden` are freed inside the graph.
    pub(crate) fn end_record(&self, logits: CudaTensor, hidden: Option<CudaTensor>) -> Result<StepGraph, String> {
        let key = self.steps.lock().unwrap().recording.ok_or("no step is being recorded")?;
        let hidden_len = hidden.as_ref().map_or(0, |h| h.rows * h.cols);
        let mut shape_ok = logits.rows == key.1 && hidden_len == key.0 * key.2;
        if shape_ok {
            let mut st = self.steps.lock().unwrap();
            let io = st.io.get_mut(&key).expect("recorded step's buffers");
            let len = logits.rows * logits.cols;
            // The buffers are keyed by rows, not vocabulary width: another model's logits do
            // not fit them (an error below, not a step that silently returns stale logits).
            shape_ok = len == io.logits.len();
            if shape_ok {
                ck(self.main_stream().memcpy_dtod(&logits.data.slice(..len), &mut io.logits), "copy step logits");
                ck(self.main_stream().memset_zeros(&mut io.flag), "clear step flag");
                super::bf16::probe_into(self, &mut io.flag, 0, &io.logits, len, logits.cols);
                let table = io.dev.slice(6 * key.0 + key.1..);
                draw_into(self, &mut io.ids, &io.logits, Some(&table), logits.rows, logits.cols);
            }
            if let Some(h) = &hidden {
                if hidden_len > 0 {
                    ck(self.main_stream().memcpy_dtod(&h.data.slice(..hidden_len), &mut io.hidden), "copy step hidden");
                }
            }
        }
        drop(logits);
        drop(hidden);
        let res = self.main_stream().end_capture(CUgraphInstantiate_flags(0));
        self.steps.lock().unwrap().recording = None;
        let graph = match res {
            Ok(Some(g)) => g,
            Ok(None) => return Err("the capture recorded nothing".into()),
            Err(e) => return Err(format!("CUDA graph capture failed: {e:?}")),
        };
        if !shape_ok {
            return Err(format!("recorded step {key:?}: the forward returned other output shapes"));
        }
        graph.upload().map_err(|e| format!("CUDA graph upload: {e:?}"))?;
        let kernels = kernel_nodes(&graph);
        Ok(StepGraph { graph, key, kernels })
    }

    pub(crate) fn replay(&self, g: &StepGraph) {
        ck(g.graph.launch(), "graph launch");
    }

    /// The replayed step's results on the host: every output row's argmax and the first
    /// `logits` rows' logits; the tapped stream means; the first output row holding a
    /// nonfinite value (one synchronisation).
    pub(crate) fn step_output(&self, g: &StepGraph, logits: usize) -> StepResult {
        let st = self.steps.lock().unwrap();
        let io = &st.io[&g.key];
        let (rows, out, hidden_cols) = g.key;
        let mut r = StepResult::default();
        if logits > 0 && out > 0 {
            // The first `logits` output rows: only those the host asked for cross.
            let cols = io.logits.len() / out;
            r.logits = self.download_reusing(&io.logits, logits.min(out) * cols);
        }
        r.ids = ck(self.main_stream().clone_dtoh(&io.ids), "download step ids");
        r.ids.truncate(out);
        if hidden_cols > 0 {
            r.hidden = ck(self.main_stream().clone_dtoh(&io.hidden), "download step hidden");
            r.hidden.truncate(rows * hidden_cols);
        }
        let f = ck(self.main_stream().clone_dtoh(&io.flag), "download step flag");
        ck(self.main_stream().synchronize(), "synchronize");
        r.nonfinite = (f[0] != 0).then(|| (u32::MAX - f[0]) as usize);
        r
    }

    /// Everything a step needs before it is recorded or replayed, outside the recorded work:
    /// entry room for its positions and the slots' written-position bookkeeping.
    pub(crate) fn prepare_step(
        &self,
        cache: &mut CudaCache,
        batch: &Batch,
        out_rows: &[usize],
        draws: &[Draw],
        cols: usize,
        hidden_cols: usize,
    ) -> u64 {
        cache.reserve_batch(self, batch);
        cache.note_written(batch);
        self.stage(batch, out_rows, draws, cols, hidden_cols);
        // The state's buffers and the kernel settings: a change of either records anew.
        cache.generation ^ self.settings_epoch().wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
}
