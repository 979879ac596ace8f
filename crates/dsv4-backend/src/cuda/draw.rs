//! A step's token per output row on the GPU (`kernels/draw.cu`; CPU twin [`crate::draw`]):
//! greedy, or a seeded draw under temperature, top-k, top-p and min-p. Recorded steps launch
//! it on their staged draw table; eager steps and the drafter's greedy choice on an uploaded
//! one or none.

use super::launch::Kernel;
use super::{ck, CudaBackend, CudaTensor};
use crate::draw::{Draw, DRAW_MAX_COLS, DRAW_WORDS};
use cudarc::driver::{CudaSlice, CudaView, LaunchConfig};

/// Writes each output row's draw into `v` (`DRAW_WORDS` words a row; rows past `draws` greedy).
pub(crate) fn draw_table(draws: &[Draw], v: &mut [u32]) {
    for (i, w) in v.chunks_exact_mut(DRAW_WORDS).enumerate() {
        w.copy_from_slice(&draws.get(i).unwrap_or(&Draw::GREEDY).words());
    }
}

/// `out[r]` = row `r`'s token under its draw in `table` (`draw.cu`; `None`: every row greedy),
/// for `x [rows, cols]`, queued on the stream (recorded steps write their ids with it).
pub(crate) fn draw_into(
    b: &CudaBackend,
    out: &mut CudaSlice<u32>,
    x: &CudaSlice<f32>,
    table: Option<&CudaView<'_, u32>>,
    rows: usize,
    cols: usize,
) {
    assert!(out.len() >= rows && x.len() >= rows * cols, "draw_into shape");
    assert!(
        cols <= DRAW_MAX_COLS,
        "draw_into: a vocabulary of {cols} tokens is past the device draw's {DRAW_MAX_COLS}"
    );
    assert!(table.is_none_or(|t| t.len() >= rows * DRAW_WORDS), "draw_into: draw table");
    if rows == 0 {
        return;
    }
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
    let null = 0u64;
    let mut l = b.stream().kernel(&b.k.draw_rows);
    l.arg(out).arg(x);
    match table {
        Some(t) => l.arg(t),
        None => l.arg(&null),
    };
    // SAFETY: argument types and sizes match the kernel's signature (a null table pointer
    // means greedy rows); sizes checked above.
    ck(unsafe { l.arg(&(cols as i32)).launch(cfg) }, "draw_rows");
}

/// Each row's token of `x` under `draws` on the host (an eager step's ids).
pub(crate) fn draw_rows(b: &CudaBackend, x: &CudaTensor, draws: &[Draw]) -> Vec<u32> {
    if x.rows == 0 {
        return Vec::new();
    }
    let mut out = b.alloc::<u32>(x.rows);
    let mut words = vec![0u32; x.rows * DRAW_WORDS];
    draw_table(draws, &mut words);
    let table = b.upload_u32(&words);
    draw_into(b, &mut out, &x.data, Some(&table.slice(..)), x.rows, x.cols);
    let mut v = ck(b.stream().clone_dtoh(&out), "download draws");
    ck(b.stream().synchronize(), "synchronize");
    v.truncate(x.rows);
    v
}
