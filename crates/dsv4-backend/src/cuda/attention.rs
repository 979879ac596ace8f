//! Launchers of `kernels/attention.cu`: the compressor (spec §9.2), the lightning indexer (§5.5)
//! and sink-softmax attention over window + compressed entries (§5.6).

use super::launch::Kernel;
use super::state::CudaCache;
use super::{block_for, cfg1d, ck, CudaBackend, CudaRows, CudaSel, CudaTensor, CudaWeight, L2Ranges};
use crate::backend::{Backend, CompSlot};
use cudarc::driver::{CudaSlice, LaunchConfig};
use dsv4_model::weights::Compressor;
use dsv4_model::Config;

/// Feeds the rows' projections into the compressor state: windows closing in the chunk are
/// pooled into entries (`comp_pool`, reading earlier rows from the raw ring), then the chunk's
/// rows enter the raw ring (`comp_store`), after the pooling has read it.
#[allow(clippy::too_many_arguments)]
pub fn compress(
    b: &CudaBackend,
    cache: &mut CudaCache,
    layer: usize,
    slot: CompSlot,
    u: &CudaTensor,
    z: &CudaTensor,
    comp: &Compressor<CudaWeight>,
    rows: &CudaRows,
    freqs: &[f64],
    cfg: &Config,
) {
    let slots = cache.slots;
    let generation = &mut cache.generation;
    let ls = &mut cache.layers[layer];
    let st = match slot {
        CompSlot::Kv => ls.comp.as_mut(),
        CompSlot::Index => ls.index.as_mut(),
    }
    .expect("compressor state missing for this layer");
    let (m, hd, w) = (st.ratio, st.head, st.width());
    assert_eq!(u.cols, w, "compressor projection width");
    let need = rows.batch.segments.iter().map(|s| (s.pos0 + s.len) / m).max().unwrap_or(0);
    if st.reserve(b, slots, need) {
        *generation += 1;
    }
    let n = rows.len() as i32;
    let f = b.freqs(freqs);
    let (mi, hdi, wi, ov, ki) = (m as i32, hd as i32, w as i32, st.overlap as i32, st.rows as i32);
    let cap = st.cap as i32;
    let pool_cfg = LaunchConfig {
        grid_dim: (rows.len() as u32, 1, 1),
        block_dim: (block_for(hd), 1, 1),
        shared_mem_bytes: (hd * 4) as u32,
    };
    // One launch where the positions a pooling reads (from 2m or m before a segment) and those
    // the store writes (the segment's) are distinct ring slots: segment length + span − 1 ≤ K.
    // Decided on the batch's short-segment flag (part of a recorded step's key, so the launch
    // suits every batch the step is replayed for) with the longest segment it allows.
    let span = if st.overlap { 2 * m } else { m };
    if b.comp_fused() && rows.batch.short_segments() && crate::batch::SHORT_SEGMENT + span - 1 <= st.rows {
        let store_blocks = (rows.len() * w).div_ceil(block_for(hd) as usize);
        let fused = LaunchConfig { grid_dim: ((rows.len() + store_blocks) as u32, 1, 1), ..pool_cfg };
        // SAFETY: argument types and buffer sizes match the kernel; blocks below n pool (reading
        // raw-ring slots of positions before their segments), the rest store (writing the
        // segments' own slots), which the check above keeps apart.
        ck(
            unsafe {
                b.stream()
                    .kernel(&b.k.comp_pool_store)
                    .arg(&mut st.entries)
                    .arg(&cap)
                    .arg(&mut st.raw_u)
                    .arg(&mut st.raw_z)
                    .arg(&ki)
                    .arg(&u.data)
                    .arg(&z.data)
                    .arg(&comp.ape.data)
                    .arg(&comp.norm.data)
                    .arg(f.as_ref())
                    .arg(&(freqs.len() as i32))
                    .arg(rows.dev.as_ref())
                    .arg(&n)
                    .arg(&mi)
                    .arg(&hdi)
                    .arg(&wi)
                    .arg(&ov)
                    .arg(&cfg.rms_eps)
                    .launch(fused)
            },
            "comp_pool_store",
        );
        return;
    }
    // SAFETY (both launches): argument types and buffer sizes match the kernels.
    ck(
        unsafe {
            b.stream()
                .kernel(&b.k.comp_pool)
                .arg(&mut st.entries)
                .arg(&cap)
                .arg(&u.data)
                .arg(&z.data)
                .arg(&st.raw_u)
                .arg(&st.raw_z)
                .arg(&ki)
                .arg(&comp.ape.data)
                .arg(&comp.norm.data)
                .arg(f.as_ref())
                .arg(&(freqs.len() as i32))
                .arg(rows.dev.as_ref())
                .arg(&n)
                .arg(&mi)
                .arg(&hdi)
                .arg(&ov)
                .arg(&cfg.rms_eps)
                .launch(pool_cfg)
        },
        "comp_pool",
    );
    ck(
        unsafe {
            b.stream()
                .kernel(&b.k.comp_store)
                .arg(&mut st.raw_u)
                .arg(&mut st.raw_z)
                .arg(&ki)
                .arg(&u.data)
                .arg(&z.data)
                .arg(&comp.ape.data)
                .arg(rows.dev.as_ref())
                .arg(&n)
                .arg(&mi)
                .arg(&wi)
                .launch(cfg1d(rows.len() * w, 256))
        },
        "comp_store",
    );
}

/// Blocks per row of `index_score` at most: each stages the row's queries once, then its 8
/// warps stride over the entries.
const INDEX_SCORE_BLOCKS: usize = 64;
/// Dynamic shared memory `index_score` may use (set on the kernel at load).
pub(crate) const INDEX_SCORE_SMEM: usize = 96 * 1024;
/// `IDX_EW` of attention.cu: entries a warp of `index_score` scores at a time.
const INDEX_SCORE_EW: usize = 4;
/// Entries a block of `index_score` is sized for (below `INDEX_SCORE_BLOCKS`): 8 warps, one
/// group of `INDEX_SCORE_EW` each.
const INDEX_SCORE_ENTRIES: usize = 8 * INDEX_SCORE_EW;

/// Blocks a row of `index_score`: one for each `INDEX_SCORE_ENTRIES` entries up to
/// `INDEX_SCORE_BLOCKS`; a small batch (fewer than [`index_score_spread`] rows) spreads each row
/// over up to `index_score_spread() / n` blocks (warp w of block y takes entry group w·Y + y, so
/// each block then has fewer busy warps on its own SM). Every entry's score is computed the same
/// way whatever the grid.
fn index_score_blocks(maxvis: usize, n: usize) -> usize {
    let base = maxvis.div_ceil(INDEX_SCORE_ENTRIES).min(INDEX_SCORE_BLOCKS);
    let groups = maxvis.div_ceil(INDEX_SCORE_EW);
    base.max(groups.min(index_score_spread() / n.max(1)))
}

/// `TOPK_SMEM` of attention.cu: bytes of index_topk's buffers (`buf`, `hist`, `wt`) that
/// `index_score_topk` carves from its dynamic shared memory.
const TOPK_SMEM: usize = 2 * 2048 * 8 + 4 * 256 * 4 + 2 * (256 / 32) * 4;

/// Blocks of `index_score` a small batch is spread over (about one an SM): `DSV4_INDEX_SPREAD`,
/// default 128. At batch 1 and 1,024 entries that is 128 blocks of 2 busy warps, each staging the
/// row's 32 KB of queries (v44's ncu: most of the scoring blocks' samples); 0 keeps the blocks
/// full (32 of 8 warps there). The same scores and selection whatever the grid.
fn index_score_spread() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::env::var("DSV4_INDEX_SPREAD").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(128))
}

/// Rows from which a fast-mode indexer call takes the tensor-core kernel (`index_score_tc`:
/// prefill chunks); decode batches keep the f32 kernel, which spreads a few rows over many
/// blocks (`index_score_tc` runs one block per `ITC_ROWS` rows).
const ITC_MIN_ROWS: usize = 256;
/// `ITC_R` of attention.cu: rows an `index_score_tc` block takes (one warp each). A block
/// streams its sequence's entries once for all of them; rows of different sequences in one
/// block take a pass over the entries each, so a batch whose segments average fewer rows than
/// this (many decode rows) keeps the f32 kernel.
const ITC_ROWS: usize = 8;
/// `ITC_SMEM` of attention.cu: `index_score_tc`'s dynamic shared memory (the block's queries and
/// two entry tiles of 64, rows of 136 bf16).
pub(crate) const ITC_SMEM: usize = (ITC_ROWS * 64 + 2 * 64) * 136 * 2;

/// Lightning-indexer top-k: scores of every visible entry (`index_score`, or `index_score_tc`
/// for prefill chunks in fast mode), then a threshold select of the k chosen per row
/// (`index_topk`, O(visible) per row), sorted by score in exact mode, in entry order in fast mode.
pub fn index_select(
    b: &CudaBackend,
    cache: &CudaCache,
    layer: usize,
    qi: &CudaTensor,
    wts: &CudaTensor,
    rows: &CudaRows,
    cfg: &Config,
) -> CudaSel {
    let st = cache.layers[layer].index.as_ref().expect("CSA layer without indexer state");
    let (nh, hd, m) = (cfg.index_n_heads, cfg.index_head_dim, st.ratio);
    let topk = cfg.index_topk.max(1);
    assert!(topk <= 2048, "index_topk {topk} > 2048 (the top-k kernel's shared-memory sort)");
    let n = rows.len();
    let mut sel = b.alloc::<u32>(n * topk);
    // A recorded step sizes the scores by the entry capacity (no host-side length enters it);
    // every kernel reads each row's visible count on the device, so the results are the same.
    let maxvis =
        if b.recording() { st.cap } else { rows.batch.rows.iter().map(|r| (r.pos + 1) / m).max().unwrap_or(0) };
    if maxvis == 0 || cfg.index_topk == 0 {
        return CudaSel { topk, idx: sel };
    }
    let mut scores = b.alloc::<f32>(n * maxvis);
    // The chosen entries score-descending (the CPU's order) in exact mode; entry order in fast
    // mode, the same set without the sort (index_topk_row).
    let sorted = i32::from(b.exact());
    let (qs, ws) = ((hd as f32).powf(-0.5), (nh as f32).powf(-0.5));
    let (ni, mi, mv) = (n as i32, m as i32, maxvis as i32);
    let tc = n >= ITC_MIN_ROWS
        && nh == 64
        && hd == 128
        && rows.batch.segments.len() * ITC_ROWS <= n
        && !b.exact()
        && b.index_tc();
    if tc {
        let lc = LaunchConfig {
            grid_dim: (n.div_ceil(ITC_ROWS) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: ITC_SMEM as u32,
        };
        // SAFETY: argument types and buffer sizes match the kernel (qi [n, 64·128], wts [n, 64],
        // the state's entries [slots, cap, 128], scores [n, maxvis] written at j < vis(t) <= maxvis).
        ck(
            unsafe {
                b.stream()
                    .kernel(&b.k.index_score_tc)
                    .arg(&mut scores)
                    .arg(&mv)
                    .arg(&qi.data)
                    .arg(&wts.data)
                    .arg(&st.entries)
                    .arg(&(st.cap as i32))
                    .arg(rows.dev.as_ref())
                    .arg(&ni)
                    .arg(&mi)
                    .arg(&qs)
                    .arg(&ws)
                    .launch(lc)
            },
            "index_score_tc",
        );
    } else {
        let smem = (hd * (nh + 1) + 8 * INDEX_SCORE_EW * hd + nh) * 4;
        assert!(
            nh <= 128 && smem <= INDEX_SCORE_SMEM,
            "indexer of {nh} heads × {hd}: over index_score's shared memory"
        );
        let lc = LaunchConfig {
            grid_dim: (n as u32, index_score_blocks(maxvis, n) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // The scores and the top-k in one launch (decode and verify rows: the flag is part of a
        // recorded step's key): each row's last block selects, on the dynamic shared memory the
        // scores used (the larger of the two needs). Its arguments: index_topk's sel and k and
        // the zeroed counters (one a row, n ≤ FFN1_COUNTERS, each left zero; launches on the
        // stream do not overlap), then index_score's.
        let fused = b.index_fused() && rows.batch.short_segments() && n <= super::bf16::FFN1_COUNTERS;
        let (mut l, lc, name) = if fused {
            let mut l = b.stream().kernel(&b.k.index_score_topk);
            l.arg(&mut sel).arg(&(topk as i32)).arg(&sorted).arg(b.counters());
            (l, LaunchConfig { shared_mem_bytes: smem.max(TOPK_SMEM) as u32, ..lc }, "index_score_topk")
        } else {
            (b.stream().kernel(&b.k.index_score), lc, "index_score")
        };
        l.arg(&mut scores)
            .arg(&mv)
            .arg(&qi.data)
            .arg(&wts.data)
            .arg(&st.entries)
            .arg(&(st.cap as i32))
            .arg(rows.dev.as_ref())
            .arg(&ni)
            .arg(&mi)
            .arg(&(nh as i32))
            .arg(&(hd as i32))
            .arg(&qs)
            .arg(&ws);
        // SAFETY: argument types and buffer sizes match the kernel chosen: sel holds n·topk,
        // scores n·maxvis (each row's written below its visible count, where both read),
        // qi, wts and entries index_score's shapes; the counters as said above.
        ck(unsafe { l.launch(lc) }, name);
        if fused {
            return CudaSel { topk, idx: sel };
        }
    }
    let lc = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: argument types and buffer sizes match the kernel.
    ck(
        unsafe {
            b.stream()
                .kernel(&b.k.index_topk)
                .arg(&mut sel)
                .arg(&(topk as i32))
                .arg(&sorted)
                .arg(&scores)
                .arg(&mv)
                .arg(rows.dev.as_ref())
                .arg(&ni)
                .arg(&mi)
                .launch(lc)
        },
        "index_topk",
    );
    CudaSel { topk, idx: sel }
}

/// `ATT_S` of attention.cu: a row's keys are cut into this many slices whatever its batch.
const ATTN_SLICES: usize = 16;
/// `ATT_HG` of attention.cu: heads a block takes (one warp each).
const ATTN_HEADS_PER_BLOCK: usize = 8;
/// Rows an attention launch takes at most (its partials: 2.1 MB a row for 64 heads of 512).
const ATTN_ROW_TILE: usize = 64;

/// Default of [`CudaBackend::attention_tc_rows`]: rows from which a fast-mode attention call
/// takes the tensor-core kernel (`attention_tc`: prefill chunks and decode batches of 32 rows
/// and more); smaller calls keep the f32 kernel, whose key slices spread a few rows over the
/// whole GPU (`attention_tc` runs one block a row and 64 heads). Batch 64 at context 4096 on 4 q2
/// layers (H200): 11.76 → 11.14 ms a step. Above the 16 rows that fast-mode batch invariance
/// covers (cuda_invariance), so a row's result at up to 16 rows never depends on its batch.
pub(crate) const ATC_MIN_ROWS: usize = 32;
/// `ATC_H` of attention.cu: heads an `attention_tc` block takes.
pub(crate) const ATC_HEADS: usize = 64;
/// Heads an `attention_tcd` block takes (decode slices, [`CudaBackend::set_attention_tc_heads`]).
pub(crate) const ATCD_HEADS: usize = 16;
/// `ATC_SMEM_OF(heads)` of attention.cu: dynamic shared memory of a block of that many heads
/// (queries and two key tiles of 16, rows of 520 bf16).
pub(crate) const fn atc_smem(heads: usize) -> usize {
    (heads + 2 * 16) * 520 * 2
}
/// `ATC_SMEM` of attention.cu: `attention_tc`'s.
pub(crate) const ATC_SMEM: usize = atc_smem(ATC_HEADS);

/// What `attention_tc` reads of a layer's state and the call, but the window ring (see
/// [`attention_tc`]).
struct AtcKeys<'a> {
    q: &'a CudaTensor,
    kv: &'a CudaTensor,
    entries: &'a CudaSlice<f32>,
    cap: usize,
    m: usize,
    sel: &'a CudaSlice<u32>,
    has_sel: i32,
    topk: usize,
    sinks: &'a CudaWeight,
    rows: &'a CudaRows,
    win: usize,
    rcap: usize,
}

/// `attention_tc` over rows `t0..t0 + rows` (block (row, hb heads, slice)), with `pf`'s L2
/// prefetch blocks past the rows: `slices` = 1 writes each row's output (prefill-sized calls);
/// more cut each row's key tiles into that many slices at most, whose partials go to `part` for
/// `attention_merge` (decode-sized calls), on blocks of `hb` heads (16: `attention_tcd`, the
/// decode default; or 64).
#[allow(clippy::too_many_arguments)]
fn attention_tc(
    b: &CudaBackend,
    k: &AtcKeys,
    ring: &CudaSlice<f32>,
    out: &mut CudaTensor,
    part: &CudaSlice<f32>,
    (t0, rows, slices): (usize, usize, usize),
    hb: usize,
    pf: &L2Ranges,
) {
    assert!(hb == ATC_HEADS || hb == ATCD_HEADS, "attention_tc: {hb} heads a block (64 or 16)");
    let h = k.q.cols / 512;
    let lc = LaunchConfig {
        grid_dim: ((rows + pf.layers as usize) as u32, (h / hb) as u32, slices as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: atc_smem(hb) as u32,
    };
    let f = if hb == ATCD_HEADS {
        b.tcd_launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        &b.k.attention_tcd
    } else {
        &b.k.attention_tc
    };
    // SAFETY: argument types and buffer sizes match the kernel (q and out [n, h·512], the
    // state's ring and entries as the f32 kernel reads them, `part` tile rows × h × ATT_S slices
    // of 514 floats where `slices` > 1).
    ck(
        unsafe {
            b.stream()
                .kernel(f)
                .arg(&mut out.data)
                .arg(&k.q.data)
                .arg(&k.kv.data)
                .arg(ring)
                .arg(&(k.win as i32))
                .arg(&(k.rcap as i32))
                .arg(k.entries)
                .arg(&(k.cap as i32))
                .arg(&(k.m as i32))
                .arg(k.sel)
                .arg(&k.has_sel)
                .arg(&(k.topk as i32))
                .arg(&k.sinks.data)
                .arg(k.rows.dev.as_ref())
                .arg(&(k.rows.len() as i32))
                .arg(&(h as i32))
                .arg(part)
                .arg(&(t0 as i32))
                .arg_struct(pf)
                .launch(lc)
        },
        "attention_tc",
    );
}

/// Attention of every (row, head), then the chunk's KV rows enter the window ring (the last
/// `window + MAX_ROLLBACK` of each segment, so that a rollback finds its window).
#[allow(clippy::too_many_arguments)]
pub fn attend(
    b: &CudaBackend,
    cache: &mut CudaCache,
    layer: usize,
    q: &CudaTensor,
    kv: &CudaTensor,
    sel: Option<&CudaSel>,
    sinks: &CudaWeight,
    rows: &CudaRows,
    freqs: &[f64],
    cfg: &Config,
) -> CudaTensor {
    let (h, d, win, rcap) = (cfg.n_heads, cfg.head_dim, cache.window, cache.ring_cap);
    assert!(d <= 512 && d % 4 == 0, "attention kernel supports head_dim <= 512, a multiple of 4; got {d}");
    let n = rows.len();
    let mut out = b.tensor(n, h * d);
    cache.note_written(&rows.batch);
    let ls = &mut cache.layers[layer];
    let (entries, cap, m) = match &ls.comp {
        Some(c) => (&c.entries, c.cap, c.ratio),
        None => (&b.dummy_f32, 0, 0),
    };
    let (seli, has_sel, topk) = match sel {
        Some(s) => (&s.idx, 1i32, s.topk),
        None => (&b.dummy_u32, 0, 0),
    };
    let scale = (d as f32).powf(-0.5);
    let (ni, di, wi, rci) = (n as i32, d as i32, win as i32, rcap as i32);
    let tc_fits = d == 512 && h.is_multiple_of(ATC_HEADS) && !b.exact() && b.attention_tc();
    let tc = tc_fits && n >= b.attention_tc_rows();
    // Decode-sized calls: attention_tc's key slices (blocks of `hb` heads), then attention_merge.
    let slices = tc_fits && !tc && b.attention_tc_slices();
    let hb = b.attention_tc_heads();
    // The weights the forward named next (wo_a), prefetched by extra x layers of the first
    // launch below (blocks a layer: the grid's y·z).
    let per_layer = if tc {
        h / ATC_HEADS
    } else if slices {
        h / hb * ATTN_SLICES
    } else {
        h.div_ceil(ATTN_HEADS_PER_BLOCK) * ATTN_SLICES
    };
    let pf = b.take_l2_ranges(n, per_layer);
    let keys = AtcKeys { q, kv, entries, cap, m, sel: seli, has_sel, topk, sinks, rows, win, rcap };
    if tc {
        attention_tc(b, &keys, &ls.ring, &mut out, &b.dummy_f32, (0, n, 1), ATC_HEADS, &pf);
    }
    // The decode kernel's epilogue (`set_att_fused`): the inverse RoPE and the output's int8
    // codes where the merge forms it, the window ring's rows written by the kernel where no slot
    // written is one read (every segment + window − 1 fits the ring), and the counters kept
    // zero between launches.
    let fused = !tc && b.att_fused() && d.is_multiple_of(32) && 2 * freqs.len() <= d;
    // On the short-segment flag of a recorded step's key, with the longest segment it allows.
    let ringw = fused && rows.batch.short_segments() && crate::batch::SHORT_SEGMENT + win - 1 <= rcap;
    let twin = fused && b.int8();
    if !tc {
        // Partials of ATT_S slices per (row, head), for ATTN_ROW_TILE rows a launch at most.
        let tile = n.min(ATTN_ROW_TILE);
        let groups = h.div_ceil(ATTN_HEADS_PER_BLOCK);
        let mut part = b.alloc::<f32>(tile * h * ATTN_SLICES * (d + 2));
        let mut fresh = None;
        let done = if slices {
            &b.dummy_u32
        } else if fused && tile * groups <= super::bf16::FFN1_COUNTERS {
            b.counters()
        } else {
            fresh.insert(ck(b.stream().alloc_zeros::<u32>(tile * groups), "alloc attention counters"))
        };
        let f = b.freqs(freqs);
        let (mut oq, mut od) = if twin {
            (b.alloc::<i8>(n * h * d), b.alloc::<f32>(n * h * d / 32))
        } else {
            (b.alloc::<i8>(1), b.alloc::<f32>(1))
        };
        let epi = if fused { 1 | (2 * twin as i32) } else { 0 };
        // SAFETY (every launch): argument types and buffer sizes match the kernels; `part` and `done`
        // hold `tile` rows, and each launch covers at most `tile` rows from `t0`.
        let pf_at = |t0: usize| if t0 == 0 { &pf } else { &L2Ranges::NONE };
        for t0 in (0..n).step_by(tile) {
            let rows_here = (n - t0).min(tile);
            if slices {
                // Block (row, hb heads, slice): each row's key tiles over up to ATTN_SLICES
                // blocks (attention_tc's `part` writes), then a block a (row, head) merges them,
                // a thread two columns (d = 512 here).
                attention_tc(b, &keys, &ls.ring, &mut out, &part, (t0, rows_here, ATTN_SLICES), hb, pf_at(t0));
                let lc = LaunchConfig {
                    grid_dim: (rows_here as u32, h as u32, 1),
                    block_dim: ((d / 2) as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                ck(
                    unsafe {
                        b.stream()
                            .kernel(&b.k.attention_merge)
                            .arg(&mut out.data)
                            .arg(&part)
                            .arg(&mut ls.ring)
                            .arg(&kv.data)
                            .arg(&wi)
                            .arg(&rci)
                            .arg(&(m as i32))
                            .arg(&has_sel)
                            .arg(&(topk as i32))
                            .arg(&sinks.data)
                            .arg(rows.dev.as_ref())
                            .arg(&ni)
                            .arg(&(t0 as i32))
                            .arg(&(h as i32))
                            .arg(&di)
                            .arg(f.as_ref())
                            .arg(&(freqs.len() as i32))
                            .arg(&epi)
                            .arg(&mut oq)
                            .arg(&mut od)
                            .arg(&(ringw as i32))
                            .arg(&(ATTN_SLICES as i32))
                            .launch(lc)
                    },
                    "attention_merge",
                );
                continue;
            }
            let lc = LaunchConfig {
                grid_dim: ((rows_here + pf_at(t0).layers as usize) as u32, groups as u32, ATTN_SLICES as u32),
                block_dim: (32 * ATTN_HEADS_PER_BLOCK as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            ck(
                unsafe {
                    b.stream()
                        .kernel(&b.k.attention)
                        .arg(&mut out.data)
                        .arg(&mut part)
                        .arg(done)
                        .arg(&q.data)
                        .arg(&kv.data)
                        .arg(&mut ls.ring)
                        .arg(&wi)
                        .arg(&rci)
                        .arg(entries)
                        .arg(&(cap as i32))
                        .arg(&(m as i32))
                        .arg(seli)
                        .arg(&has_sel)
                        .arg(&(topk as i32))
                        .arg(&sinks.data)
                        .arg(rows.dev.as_ref())
                        .arg(&ni)
                        .arg(&(t0 as i32))
                        .arg(&(h as i32))
                        .arg(&di)
                        .arg(&scale)
                        .arg(f.as_ref())
                        .arg(&(freqs.len() as i32))
                        .arg(&epi)
                        .arg(&mut oq)
                        .arg(&mut od)
                        .arg(&(ringw as i32))
                        .arg_struct(pf_at(t0))
                        .launch(lc)
                },
                "attention",
            );
        }
        if twin {
            let _ = out.x8.set(super::X8Twin { q: oq, d: od });
        }
    }
    if !fused {
        b.rope(&mut out, rows, freqs, d, true);
    }
    if ringw {
        return out;
    }
    // SAFETY: argument types and buffer sizes match the kernel.
    ck(
        unsafe {
            b.stream()
                .kernel(&b.k.ring_write)
                .arg(&mut ls.ring)
                .arg(&rci)
                .arg(&kv.data)
                .arg(rows.dev.as_ref())
                .arg(&ni)
                .arg(&di)
                .launch(cfg1d(n * d, 256))
        },
        "ring_write",
    );
    out
}
