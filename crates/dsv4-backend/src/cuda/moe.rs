//! Launchers of `kernels/moe.cu`: the router (spec §6.1) and the routed experts.

use super::launch::Kernel;
use super::{cfg1d, ck, CudaBackend, CudaRoute, CudaRows, CudaTensor, CudaWeight};
use cudarc::driver::{CudaSlice, LaunchConfig};
use dsv4_model::weights::Expert;
use dsv4_model::Config;
use std::sync::Arc;

pub fn route(
    b: &CudaBackend,
    logits: &CudaTensor,
    bias: Option<&CudaWeight>,
    hash: Option<(&[u32], &CudaRows)>,
    cfg: &Config,
) -> CudaRoute {
    let (n, e, k) = (logits.rows, logits.cols, cfg.n_experts_per_tok);
    assert!(k <= 16, "n_experts_per_tok {k} > 16");
    assert!(e <= 1024, "{e} experts > 1024 (the router's shared scores)");
    let mut ids = b.alloc::<u32>(n * k);
    let mut weights = b.alloc::<f32>(n * k);
    // Hash layers: the table on the device, indexed by the row table's tokens.
    let table = hash.map(|(t, rows)| {
        assert_eq!(rows.len(), n, "hash routing: {} rows for {n} logits rows", rows.len());
        (b.hash_table(t), rows.dev.clone())
    });
    let (hd, rd) = match &table {
        Some((t, r)) => (t.as_ref(), r.as_ref()),
        None => (&b.dummy_u32, &b.dummy_u32),
    };
    let bd = match (bias, hash) {
        (_, Some(_)) => &b.dummy_f32,
        (Some(bias), None) => &bias.data,
        (None, None) => panic!("learned routing needs a bias"),
    };
    // SAFETY: argument types and buffer sizes match the kernel.
    ck(
        unsafe {
            b.stream
                .kernel(&b.k.route)
                .arg(&mut ids)
                .arg(&mut weights)
                .arg(&logits.data)
                .arg(bd)
                .arg(hd)
                .arg(rd)
                .arg(&(hash.is_some() as i32))
                .arg(&(n as i32))
                .arg(&(e as i32))
                .arg(&(k as i32))
                .arg(&(cfg.norm_topk_prob as i32))
                .arg(&cfg.routed_scale)
                .launch(LaunchConfig { grid_dim: (n.max(1) as u32, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 })
        },
        "route",
    );
    CudaRoute { k, experts: e, ids, weights }
}

/// The device table `[w1 of each expert, w3 of each, w2 of each]` of weight pointers (built once
/// per expert set).
pub(crate) fn expert_table(b: &CudaBackend, experts: &[Expert<CudaWeight>]) -> Arc<CudaSlice<u64>> {
    let p = |w: &CudaWeight| match &w.bf {
        Some(bf) => b.dev_ptr(bf),
        None => b.dev_ptr(&w.data),
    };
    let mut ptrs: Vec<u64> = experts.iter().map(|e| p(&e.w1)).collect();
    ptrs.extend(experts.iter().map(|e| p(&e.w3)));
    ptrs.extend(experts.iter().map(|e| p(&e.w2)));
    b.address_table(ptrs)
}

/// `Σ_j w_j · Expert_{id_j}(x)`: per (row, slot) up-projection + activation, down-projection,
/// then a weighted sum in routing order. Three launches whatever the batch.
pub fn moe(
    b: &CudaBackend,
    x: &CudaTensor,
    route: &CudaRoute,
    experts: &[Expert<CudaWeight>],
    first: usize,
    limit: f32,
) -> CudaTensor {
    // A rank of an expert-parallel group holds experts `first..first + experts.len()` only.
    let share = first != 0 || experts.len() != route.experts;
    if experts[0].w1.bf.is_some() || experts[0].w1.q.is_some() {
        return super::bf16::moe(b, x, route, experts, first, share, limit);
    }
    // These kernels index every expert by its global id.
    assert!(!share, "expert parallelism needs bf16 or packed expert weights (this backend holds f32)");
    let (n, d, k) = (x.rows, x.cols, route.k);
    let inter = experts[0].w1.rows;
    let ne = experts.len() as i32;
    let slots = n * k;
    let table = expert_table(b, experts);
    let mut h = b.alloc::<f32>(slots * inter);
    let mut y = b.alloc::<f32>(slots * d);
    let mut out = b.tensor(n, d);
    if n == 0 {
        return out;
    }
    let up = LaunchConfig {
        grid_dim: (slots as u32, inter.div_ceil(8) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let down =
        LaunchConfig { grid_dim: (slots as u32, d.div_ceil(8) as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (ki, di, ii) = (k as i32, d as i32, inter as i32);
    // SAFETY (both launches): argument types and buffer sizes match the kernels.
    ck(
        unsafe {
            b.stream
                .kernel(&b.k.moe_up)
                .arg(&mut h)
                .arg(&x.data)
                .arg(&route.ids)
                .arg(table.as_ref())
                .arg(&ne)
                .arg(&ki)
                .arg(&di)
                .arg(&ii)
                .arg(&limit)
                .launch(up)
        },
        "moe_up",
    );
    ck(
        unsafe {
            b.stream
                .kernel(&b.k.moe_down)
                .arg(&mut y)
                .arg(&h)
                .arg(&route.ids)
                .arg(table.as_ref())
                .arg(&ne)
                .arg(&di)
                .arg(&ii)
                .launch(down)
        },
        "moe_down",
    );
    combine(b, &mut out, &y, &route.weights, k);
    out
}

/// `out[r] = Σ_j w[r, j] · y[r·k + j]` in routing order (`moe_combine`): the routed experts'
/// slot outputs weighted and added, for `out.rows` rows of `out.cols`.
pub(crate) fn combine(b: &CudaBackend, out: &mut CudaTensor, y: &CudaSlice<f32>, weights: &CudaSlice<f32>, k: usize) {
    let (n, d) = (out.rows, out.cols);
    // SAFETY: argument types and buffer sizes match the kernel (y holds n·k rows of d, weights n·k).
    ck(
        unsafe {
            b.stream
                .kernel(&b.k.moe_combine)
                .arg(&mut out.data)
                .arg(y)
                .arg(weights)
                .arg(&(n as i32))
                .arg(&(k as i32))
                .arg(&(d as i32))
                .launch(cfg1d(n * d, 256))
        },
        "moe_combine",
    );
}
