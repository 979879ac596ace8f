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
    let (n, e) = (logits.rows, logits.cols);
    let mut r = RouteArgs::new(b, n, e, bias, hash, cfg);
    let (hd, rd) = hash_tables(&r.hash, b);
    // SAFETY: argument types and buffer sizes match the kernel.
    ck(
        unsafe {
            b.stream()
                .kernel(&b.k.route)
                .arg(&mut r.ids)
                .arg(&mut r.weights)
                .arg(&logits.data)
                .arg(r.bias)
                .arg(hd)
                .arg(rd)
                .arg(&r.use_hash)
                .arg(&(n as i32))
                .arg(&(e as i32))
                .arg(&(r.k as i32))
                .arg(&r.norm_topk)
                .arg(&r.scale)
                .launch(LaunchConfig { grid_dim: (n.max(1) as u32, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 })
        },
        "route",
    );
    r.finish(e)
}

/// Rows up to which [`router_fused`] applies: one a warp of the last block (more would queue
/// behind each other in one block, where `route` gives each row a block).
const ROUTER_FUSED_ROWS: usize = 8;

/// Whether [`router_fused`] forms `x · gateᵀ` as [`crate::Backend::matmul`] would: an f32
/// weight on `gemv_f32` ([`CudaBackend::gemm_xwt`]'s condition and block size), whose one block
/// an expert makes the grid the launch's last block counts.
pub(crate) fn router_fits(b: &CudaBackend, x: &CudaTensor, gate: &CudaWeight) -> bool {
    gate.q.is_none()
        && gate.bf.is_none()
        && x.cols == gate.cols
        && (1..=ROUTER_FUSED_ROWS).contains(&x.rows)
        && (1..=1024).contains(&gate.rows)
        && (x.rows <= super::bf16::gemv_rows() || b.exact())
}

/// The router's logits and its choice in one launch (`gemv_route`; see
/// [`CudaBackend::set_route_fused`]): `gemv_f32`'s grid of one block an expert, whose last block
/// to finish runs `route`'s warps over the rows.
pub(crate) fn router_fused(
    b: &CudaBackend,
    x: &CudaTensor,
    gate: &CudaWeight,
    bias: Option<&CudaWeight>,
    hash: Option<(&[u32], &CudaRows)>,
    cfg: &Config,
) -> (CudaTensor, CudaRoute) {
    let (n, k, e) = (x.rows, x.cols, gate.rows);
    let mut logits = b.tensor(n, e);
    let mut r = RouteArgs::new(b, n, e, bias, hash, cfg);
    let (hd, rd) = hash_tables(&r.hash, b);
    // gemv_f32's block size (gemm_xwt), and e scores in dynamic shared memory for each warp
    // that routes a row (warp w < n; at most 8 · 1024 floats, under the 48 KiB default).
    let threads: u32 = if k >= 8192 { 1024 } else { 256 };
    let routing_warps = n.min(threads as usize / 32);
    let lc = LaunchConfig {
        grid_dim: (e as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: (routing_warps * e * std::mem::size_of::<f32>()) as u32,
    };
    // SAFETY: argument types and buffer sizes match the kernel: x holds n rows of k, the gate
    // e rows of k, logits n·e, ids and weights n·k_routed; the counter is the backend's zeroed
    // one (each launch leaves it zero; launches on the stream do not overlap); the dynamic
    // shared memory holds e scores for each warp that routes (warp w takes rows w, w + warps,
    // ..., so only the warps below n).
    ck(
        unsafe {
            b.stream()
                .kernel(&b.k.gemv_route)
                .arg(&mut logits.data)
                .arg(&x.data)
                .arg(&gate.data)
                .arg(&(n as i32))
                .arg(&(k as i32))
                .arg(&(e as i32))
                .arg(b.counters())
                .arg(&mut r.ids)
                .arg(&mut r.weights)
                .arg(r.bias)
                .arg(hd)
                .arg(rd)
                .arg(&r.use_hash)
                .arg(&(r.k as i32))
                .arg(&r.norm_topk)
                .arg(&r.scale)
                .launch(lc)
        },
        "gemv_route",
    );
    b.route_fused_launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    (logits, r.finish(e))
}

/// A hash layer's device `tid2eid` table and the step's row table.
type HashDev = (Arc<CudaSlice<u32>>, Arc<CudaSlice<u32>>);

/// A hash layer's `tid2eid` table and row table (RouteArgs::hash), or the backend's dummies.
fn hash_tables<'s>(t: &'s Option<HashDev>, b: &'s CudaBackend) -> (&'s CudaSlice<u32>, &'s CudaSlice<u32>) {
    match t {
        Some((t, r)) => (t.as_ref(), r.as_ref()),
        None => (&b.dummy_u32, &b.dummy_u32),
    }
}

/// The router kernels' arguments besides the logits: the outputs, the bias (or the backend's
/// dummy) and a hash layer's device tables.
struct RouteArgs<'a> {
    ids: CudaSlice<u32>,
    weights: CudaSlice<f32>,
    bias: &'a CudaSlice<f32>,
    hash: Option<HashDev>,
    use_hash: i32,
    k: usize,
    norm_topk: i32,
    scale: f32,
}

impl<'a> RouteArgs<'a> {
    fn new(
        b: &'a CudaBackend,
        n: usize,
        e: usize,
        bias: Option<&'a CudaWeight>,
        hash: Option<(&[u32], &CudaRows)>,
        cfg: &Config,
    ) -> Self {
        let k = cfg.n_experts_per_tok;
        assert!(k <= 16, "n_experts_per_tok {k} > 16");
        assert!(e <= 1024, "{e} experts > 1024 (the router's shared scores)");
        // Hash layers: the table on the device, indexed by the row table's tokens.
        let tables = hash.map(|(t, rows)| {
            assert_eq!(rows.len(), n, "hash routing: {} rows for {n} logits rows", rows.len());
            (b.hash_table(t), rows.dev.clone())
        });
        let bias = match (bias, hash) {
            (_, Some(_)) => &b.dummy_f32,
            (Some(bias), None) => &bias.data,
            (None, None) => panic!("learned routing needs a bias"),
        };
        RouteArgs {
            ids: b.alloc::<u32>(n * k),
            weights: b.alloc::<f32>(n * k),
            bias,
            hash: tables,
            use_hash: hash.is_some() as i32,
            k,
            norm_topk: cfg.norm_topk_prob as i32,
            scale: cfg.routed_scale,
        }
    }

    fn finish(self, e: usize) -> CudaRoute {
        CudaRoute { k: self.k, experts: e, ids: self.ids, weights: self.weights }
    }
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
            b.stream()
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
            b.stream()
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
            b.stream()
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
