//! `dsv4 debug diff`: the CPU oracle and the CUDA backend on the same input, every stage
//! captured on both and compared in forward order (`dsv4_backend::diff`).

use anyhow::Result;

#[derive(clap::Subcommand)]
pub enum DebugCmd {
    /// CPU vs CUDA, stage by stage: per-stage max abs / max rel error and the first (layer,
    /// stage, row) beyond tolerance or nonfinite. Exit code 0 when every stage is within
    /// tolerance, 1 otherwise. Needs a build with `--features cuda`.
    Diff(DiffArgs),
}

#[derive(clap::Args)]
pub struct DiffArgs {
    #[arg(long)]
    pub model: std::path::PathBuf,
    /// Comma-separated ids, or @file.json holding a JSON list.
    #[arg(long)]
    pub tokens: String,
    /// Chunk sizes, comma-separated; must sum to the number of tokens (default: one chunk).
    #[arg(long)]
    pub chunks: Option<String>,
    /// Largest max|cuda − cpu| / max|cpu| accepted per stage.
    #[arg(long, default_value_t = 1e-4)]
    pub rel_tol: f64,
    /// CUDA fast path (bf16 activations in large products) instead of exact mode (f32
    /// activations); expect errors near 1e-3 and raise --rel-tol.
    #[arg(long)]
    pub fast: bool,
    /// f32 weights on the GPU, compared with the unrounded CPU (default: bf16 weights on the
    /// GPU, CPU weights rounded to bf16 on load).
    #[arg(long)]
    pub f32_weights: bool,
}

/// Runs the command; `Ok(false)` when a stage is beyond tolerance or nonfinite.
pub fn run(cmd: DebugCmd) -> Result<bool> {
    match cmd {
        DebugCmd::Diff(a) => diff(a),
    }
}

#[cfg(not(feature = "cuda"))]
fn diff(_a: DiffArgs) -> Result<bool> {
    anyhow::bail!("`dsv4 debug diff` compares the CPU and CUDA backends: this dsv4 was built without CUDA; rebuild with `cargo build --release -p dsv4 --features cuda`")
}

#[cfg(feature = "cuda")]
fn diff(a: DiffArgs) -> Result<bool> {
    use crate::cli_util::{parse_list, parse_tokens};
    use anyhow::{bail, Context};
    use dsv4_backend::cpu::CpuBackend;
    use dsv4_backend::cuda::CudaBackend;
    use dsv4_backend::diff::{diff_stages, Recorder};
    use dsv4_backend::{Batch, Model, ModelError};

    let toks = parse_tokens(&a.tokens)?;
    if toks.is_empty() {
        bail!("--tokens is empty");
    }
    let chunks = match &a.chunks {
        Some(c) => parse_list(c).context("--chunks")?,
        None => vec![toks.len()],
    };
    let sum: usize = chunks.iter().sum();
    if sum != toks.len() || chunks.contains(&0) {
        bail!("--chunks {chunks:?} must be positive and sum to the {} tokens", toks.len());
    }
    let gpu_b = if a.f32_weights { CudaBackend::new_f32(0) } else { CudaBackend::new(0) }
        .context("starting the CUDA backend")?;
    gpu_b.set_exact(!a.fast);
    // The exact path compares f32 products stage by stage; int8 activations only with --fast.
    gpu_b.set_int8(a.fast && gpu_b.int8());
    let round = gpu_b.bf16;
    let mut cpu = Model::load_with(CpuBackend, &a.model, 1, true, |t| {
        if round {
            dsv4_backend::bf16::round_weight(t)
        }
    })
    .with_context(|| format!("loading {} on the CPU", a.model.display()))?;
    let mut gpu =
        Model::load(gpu_b, &a.model, 1, true).with_context(|| format!("loading {} on CUDA", a.model.display()))?;
    eprintln!(
        "diff: {} tokens in chunks {chunks:?}; CUDA {} weights, {} mode; CPU weights {}",
        toks.len(),
        if round { "bf16" } else { "f32" },
        if a.fast { "fast" } else { "exact" },
        if round { "rounded to bf16" } else { "f32" }
    );
    let (sc, sg) = (cpu.alloc_seq()?, gpu.alloc_seq()?);
    let (mut rc, mut rg) = (Recorder::default(), Recorder::default());
    let mut off = 0;
    for (i, &n) in chunks.iter().enumerate() {
        rc.chunk = i;
        rg.chunk = i;
        let all: Vec<usize> = (0..n).collect();
        let part = &toks[off..off + n];
        let r1 = cpu.forward_with(&Batch::chunk(sc, off, part)?, &all, Some(&mut rc));
        let r2 = gpu.forward_with(&Batch::chunk(sg, off, part)?, &all, Some(&mut rg));
        for (side, r) in [("cpu", r1), ("cuda", r2)] {
            match r {
                Ok(_) => {}
                Err(e @ ModelError::NonFinite { .. }) => eprintln!("chunk {i}: {side}: {e}"),
                Err(e) => return Err(e).context(format!("chunk {i} on {side}")),
            }
        }
        off += n;
    }
    let report = diff_stages(&rg.stages, &rc.stages, a.rel_tol)?;
    print!("{}", report.render());
    Ok(report.first_bad().is_none())
}
