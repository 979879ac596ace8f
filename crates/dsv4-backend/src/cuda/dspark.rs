//! The DSpark drafter's ops on the GPU (`kernels/dspark.cu`): non-causal block attention over
//! per-sequence context rings, ring row writes, and the greedy Markov choice (a row argmax by
//! `draw.cu`'s kernel, so that only `γ` token ids per sequence come back to the host, never a
//! `[vocab]` logits row).
//!
//! The module is compiled and loaded once per device on first use (kept apart from
//! [`super::Kernels`]).

use super::launch::Kernel;
use super::{cfg1d, ck, CudaBackend, CudaTensor, CudaWeight};
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig};
use std::sync::{Arc, Mutex};

pub(crate) const SOURCE: (&str, &str) = ("dspark.cu", include_str!("kernels/dspark.cu"));

pub(crate) struct DsparkKernels {
    scatter_rows: CudaFunction,
    block_attention: CudaFunction,
    block_attention_h: CudaFunction,
    markov_argmax: CudaFunction,
}

/// Per device ordinal (every backend of a device shares its primary context).
static LOADED: Mutex<Vec<(usize, Arc<DsparkKernels>)>> = Mutex::new(Vec::new());

fn kernels(b: &CudaBackend) -> Arc<DsparkKernels> {
    let ord = b.ctx.ordinal();
    let mut l = LOADED.lock().unwrap();
    if let Some((_, k)) = l.iter().find(|(o, _)| *o == ord) {
        return k.clone();
    }
    let m = ck(super::load_kernel_module(&b.ctx, SOURCE.0, SOURCE.1), "load dspark.cu");
    let f = |n: &str| ck(super::load_function(&m, n), n);
    let k = Arc::new(DsparkKernels {
        scatter_rows: f("scatter_rows"),
        block_attention: f("block_attention"),
        block_attention_h: f("block_attention_h"),
        markov_argmax: f("markov_argmax"),
    });
    l.push((ord, k.clone()));
    k
}

pub(crate) fn to_device(b: &CudaBackend, rows: usize, cols: usize, data: &[f32]) -> CudaTensor {
    assert_eq!(data.len(), rows * cols, "to_device shape");
    let mut t = b.tensor(rows, cols);
    if !data.is_empty() {
        ck(b.stream().memcpy_htod(data, &mut t.data), "upload rows");
    }
    t
}

pub(crate) fn scatter_rows(b: &CudaBackend, dst: &mut CudaTensor, src: &CudaTensor, dst_rows: &[usize]) {
    assert_eq!((src.rows, src.cols), (dst_rows.len(), dst.cols), "scatter_rows shape");
    assert!(dst_rows.iter().all(|&r| r < dst.rows), "scatter_rows: row out of range");
    if dst_rows.is_empty() {
        return;
    }
    let k = kernels(b);
    let idx: Vec<u32> = dst_rows.iter().map(|&r| r as u32).collect();
    let idx = b.upload_u32(&idx);
    // SAFETY: argument types and sizes match the kernel's signature; rows checked above.
    ck(
        unsafe {
            b.stream()
                .kernel(&k.scatter_rows)
                .arg(dst.data_mut())
                .arg(&src.data)
                .arg(&idx)
                .arg(&(src.rows as i32))
                .arg(&(src.cols as i32))
                .launch(cfg1d(src.rows * src.cols, 256))
        },
        "scatter_rows",
    );
}

pub(crate) fn argmax_rows(b: &CudaBackend, x: &CudaTensor) -> Vec<u32> {
    if x.rows == 0 {
        return Vec::new();
    }
    let out = argmax_ids(b, x);
    let mut v = ck(b.stream().clone_dtoh(&out), "download argmax");
    ck(b.stream().synchronize(), "synchronize");
    v.truncate(x.rows);
    v
}

/// Each row's first maximum into a device buffer of `x.rows` ids (at least one slot).
pub(crate) fn argmax_ids(b: &CudaBackend, x: &CudaTensor) -> CudaSlice<u32> {
    let mut out = b.alloc::<u32>(x.rows);
    if x.rows > 0 {
        // draw.cu's kernel without a draw table: every row greedy.
        super::draw::draw_into(b, &mut out, &x.data, None, x.rows, x.cols);
    }
    out
}

pub(crate) fn block_attention(
    b: &CudaBackend,
    q: &CudaTensor,
    kb: &CudaTensor,
    rings: &[&CudaTensor],
    slots: &[Vec<usize>],
    sinks: &CudaWeight,
    heads: usize,
) -> CudaTensor {
    let hd = kb.cols;
    let groups = rings.len();
    assert_eq!(slots.len(), groups, "one slot list per ring");
    assert!(groups > 0 && q.rows.is_multiple_of(groups) && kb.rows == q.rows, "block rows per group");
    assert_eq!(q.cols, heads * hd, "query width");
    let qpg = q.rows / groups;
    let mut flat: Vec<u32> = Vec::new();
    let mut off = vec![0u32];
    for (ring, sl) in rings.iter().zip(slots) {
        assert!(sl.iter().all(|&s| s < ring.rows) && ring.cols == hd, "ring slot or width");
        flat.extend(sl.iter().map(|&s| s as u32));
        off.push(flat.len() as u32);
    }
    let max_keys = slots.iter().map(Vec::len).max().unwrap_or(0) + qpg;
    // block_attention_h: BAH = 4 heads a block where hd is 512 (V4's) and its scores fit the
    // shared memory; else a head a block.
    let by_heads =
        hd == BAH_HD && heads.is_multiple_of(BAH) && b.block_attention_heads() && max_keys * (8 + 4 * BAH) <= 48 << 10;
    // Each key's address (8 bytes) and its score a head (4).
    let smem = max_keys * if by_heads { 8 + 4 * BAH } else { 12 };
    assert!(smem <= 48 << 10, "block attention over {max_keys} keys: past the kernel's shared memory");
    let ptrs: Vec<u64> = rings.iter().map(|r| b.dev_ptr(&r.data)).collect();
    let ptrs = ck(b.stream().clone_htod(&ptrs), "upload ring table");
    let slots_d = b.upload_u32(&flat);
    let off_d = b.upload_u32(&off);
    let mut out = b.tensor(q.rows, q.cols);
    let k = kernels(b);
    let cfg = LaunchConfig {
        grid_dim: (q.rows as u32, if by_heads { heads / BAH } else { heads } as u32, 1),
        block_dim: (if by_heads { 256 } else { 128 }, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let f = if by_heads { &k.block_attention_h } else { &k.block_attention };
    // SAFETY: argument types and sizes match the kernels' signatures (the same parameters; the
    // 4-head kernel is taken at hd = 512 only); every slot is inside its ring (checked above) and
    // the ring table lives until the stream has run the kernel (it is freed in stream order).
    ck(
        unsafe {
            b.stream()
                .kernel(f)
                .arg(&mut out.data)
                .arg(&q.data)
                .arg(&kb.data)
                .arg(&ptrs)
                .arg(&slots_d)
                .arg(&off_d)
                .arg(&sinks.data)
                .arg(&(heads as i32))
                .arg(&(hd as i32))
                .arg(&(qpg as i32))
                .launch(cfg)
        },
        "block_attention",
    );
    out
}

/// dspark.cu's `BAH` (heads a block of `block_attention_h`) and the head width it is built for.
const BAH: usize = 4;
const BAH_HD: usize = 512;

/// dspark.cu's `MK_KB`: k32 blocks a warp of `markov_argmax` holds (the rank is at most 256·MK_KB).
const MK_KB: usize = 2;

/// [`crate::Backend::markov_argmax`] in one launch (`markov_argmax`), where it gives the ids of
/// the separate ops: fast mode with the bf16 products on their tiles (the kernel forms
/// `gemvt_bf16`'s sums), a bf16 `markov_w2`, rows `u0 + i·step` of `u`, at most 16 sequences.
/// `None` where it does not apply (the caller composes the ops).
pub(crate) fn markov_argmax(
    b: &CudaBackend,
    u: &CudaTensor,
    rows: &[usize],
    prev: &super::CudaIds,
    w1: &CudaWeight,
    w2: &CudaWeight,
) -> Option<CudaSlice<u32>> {
    let n = rows.len();
    let (v, r) = (w2.rows, w2.cols);
    let w2b = w2.bf.as_ref()?;
    let step = if n > 1 { rows[1].checked_sub(rows[0])? } else { 0 };
    let progression = rows.iter().enumerate().all(|(i, &x)| x == rows[0] + i * step);
    let fits = b.markov_fused()
        && super::bf16::tiles_take(b, n, r)
        && (1..=16).contains(&n)
        && progression
        && r.is_multiple_of(32)
        && r <= 256 * MK_KB
        && w1.cols == r
        && u.cols == v
        && rows.iter().all(|&x| x < u.rows)
        && prev.n == n;
    if !fits {
        return None;
    }
    let k = kernels(b);
    let blocks = v.div_ceil(16).min(8 * b.sm_count());
    let mut ids = b.alloc::<u32>(n);
    let (mut pv, mut pi) = (b.alloc::<f32>(16 * blocks), b.alloc::<i32>(16 * blocks));
    let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let null = 0u64;
    // SAFETY: argument types match the kernel's signature; u holds rows rows[i] < u.rows of v
    // values, prev n ids below w1.rows (the drafter's own choices or the anchors, token ids of
    // the vocabulary w1 covers), w1 holds its rows of r values in the one of w1f / w1b not null,
    // w2 v·r bf16 values; pv / pi hold 16 entries a block; the counter is zero between launches
    // and left zero.
    ck(
        unsafe {
            let mut l = b.stream().kernel(&k.markov_argmax);
            l.arg(&mut ids).arg(&mut pv).arg(&mut pi).arg(b.counters()).arg(&u.data);
            l.arg(&(step as i32)).arg(&(rows[0] as i32)).arg(&prev.dev);
            match &w1.bf {
                Some(w1b) => l.arg(&null).arg(w1b),
                None => l.arg(&w1.data).arg(&null),
            };
            l.arg(w2b).arg(&(n as i32)).arg(&(r as i32)).arg(&(v as i32)).launch(cfg)
        },
        "markov_argmax",
    );
    b.markov_launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Some(ids)
}
