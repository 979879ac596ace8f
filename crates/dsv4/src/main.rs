//! `dsv4`: the DeepSeek V4 engine's command line.

mod bench;
mod cli_util;
mod debug;
mod demo;
#[cfg(feature = "cuda")]
mod flash_bench;
#[cfg(feature = "cuda")]
mod kernel_bench;
mod quantize;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use cli_util::{parse_list, parse_tokens, write_npy};
use dsv4_backend::comm::Comm;
use dsv4_backend::cpu::CpuBackend;
use dsv4_backend::{Backend, Model};
use dsv4_engine::{generate, generate_speculative, GenerateOptions, Sampler, SamplingParams, SpecConfig, StopReason};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "dsv4", version, about = "DeepSeek V4 inference engine")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum BackendKind {
    Cpu,
    /// NVIDIA GPU (build with `--features cuda`).
    Cuda,
}

/// Runs `$f(backend, args...)` with the backend the user chose.
macro_rules! with_backend {
    ($kind:expr, $f:ident($($arg:expr),*)) => {
        match $kind {
            BackendKind::Cpu => $f(CpuBackend, $($arg),*),
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => $f(dsv4_backend::cuda::CudaBackend::new(0).context("starting the CUDA backend")?, $($arg),*),
            #[cfg(not(feature = "cuda"))]
            BackendKind::Cuda => bail!("this dsv4 was built without CUDA; rebuild with `--features cuda`"),
        }
    };
}

#[derive(Subcommand)]
// Parsed once at start: the size of `serve`'s arguments costs nothing.
#[allow(clippy::large_enum_variant)]
enum Cmd {
    /// Logits at every input position, fed in the given chunks, as a float32 .npy [T, vocab].
    Logits(LogitsArgs),
    /// Generate a continuation (greedy when --temperature is 0).
    Generate(GenerateArgs),
    /// Write a small random DeepSeek V4 checkpoint with every layer type.
    InitTiny {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Measure prefill and decode speed.
    Bench(bench::BenchArgs),
    /// OpenAI- and Anthropic-compatible HTTP server with continuous batching.
    Serve(ServeArgs),
    /// Quantise a checkpoint to a GGUF (ds4's tensor names and type policy; the config rides along
    /// as metadata, so `--model X.gguf` works everywhere).
    Quantize(quantize::QuantizeArgs),
    /// Show a checkpoint's format, tensor types and memory per component.
    Inspect(quantize::InspectArgs),
    /// Compile the CUDA kernels into the kernel cache (`DSV4_KERNEL_CACHE`, else
    /// `$XDG_CACHE_HOME/dsv4/ptx` or `~/.cache/dsv4/ptx`) without a GPU, so that a machine with the same NVRTC version starts
    /// without compiling them.
    CompileKernels,
    /// Debugging tools (`debug diff`: CPU vs CUDA stage by stage).
    #[command(subcommand)]
    Debug(debug::DebugCmd),
}

#[derive(clap::Args)]
struct LogitsArgs {
    #[arg(long)]
    model: PathBuf,
    /// Comma-separated ids, or @file.json holding a JSON list.
    #[arg(long)]
    tokens: String,
    /// Chunk sizes, comma-separated; must sum to the number of tokens (default: one chunk).
    #[arg(long)]
    chunks: Option<String>,
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
    /// Ranks to split the model over (tensor + expert parallel, a thread each): in-process
    /// ranks with `--backend cpu`; GPUs 0..N over NCCL with `--backend cuda` (not yet run on
    /// hardware; docs/multi-gpu.md).
    #[arg(long, default_value_t = 1)]
    gpus: usize,
    #[arg(long)]
    out: PathBuf,
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// Checkpoint directory; without it the built-in demo model (random weights) is used.
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, conflicts_with = "tokens")]
    prompt: Option<String>,
    #[arg(long)]
    tokens: Option<String>,
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Longest prefill chunk (default: what `serve` takes as its token budget, from free
    /// device memory: 512 to 8192 tokens; 512 on the CPU).
    #[arg(long)]
    prefill_chunk: Option<usize>,
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
    /// Ranks to split the model over (tensor + expert parallel, a thread each): in-process
    /// ranks with `--backend cpu`; GPUs 0..N over NCCL with `--backend cuda` (not yet run on
    /// hardware; docs/multi-gpu.md).
    #[arg(long, default_value_t = 1)]
    gpus: usize,
    /// Print {"tokens":[...],"text":"...",...} instead of the text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    dspark: DsparkArgs,
}

/// DSpark speculative decoding (the checkpoint's `mtp.*` block drafter).
#[derive(clap::Args, Clone)]
struct DsparkArgs {
    /// Speculate with the checkpoint's DSpark drafter (lossless: greedy output equals plain
    /// greedy; at temperature > 0, `serve` gives a seeded request's plain tokens exactly, and
    /// `generate` keeps the target's distribution by rejection sampling).
    #[arg(long)]
    dspark: bool,
    /// Longest draft verified per round (default: the drafter's block size).
    #[arg(long, requires = "dspark")]
    dspark_max_draft: Option<usize>,
    /// Stop drafting for a sequence while its acceptance does not pay for the verify rows
    /// (cost measured on the backend at startup).
    #[arg(long, requires = "dspark")]
    dspark_adaptive: bool,
}

impl DsparkArgs {
    /// Loads the drafter of `dir` when `--dspark` is given.
    fn config<B: Backend>(
        &self,
        dir: &std::path::Path,
        model: &mut Model<B>,
        sampled: bool,
    ) -> Result<Option<SpecConfig>> {
        if !self.dspark {
            return Ok(None);
        }
        let proposer = drafter_for(model.backend.name(), dir)
            .with_context(|| format!("loading the DSpark drafter of {}", dir.display()))?;
        let mut sc = SpecConfig::new(proposer);
        if let Some(l) = self.dspark_max_draft {
            sc.max_draft = l;
        }
        sc.sampled = sampled;
        if self.dspark_adaptive {
            sc.policy.adaptive = true;
            sc.policy.verify_cost = dsv4_engine::speculative::measure_verify_cost(model, sc.max_len(), 5)?;
            tracing::info!("DSpark verify cost (x a 1-row decode) per draft length: {:?}", sc.policy.verify_cost);
        }
        Ok(Some(sc))
    }
}

/// The DSpark drafter on the target's backend: with `--backend cuda` it runs on the GPU (its
/// weights and context rings on the device), otherwise on the CPU.
fn drafter_for(backend: &str, dir: &std::path::Path) -> Result<std::sync::Arc<dyn dsv4_engine::Proposer>> {
    #[cfg(feature = "cuda")]
    if backend == "cuda" {
        let b = dsv4_backend::cuda::CudaBackend::new(0).context("starting the CUDA backend for the drafter")?;
        let d = dsv4_dspark::Drafter::load_dir_on(b, dir)?;
        tracing::info!("DSpark drafter on the GPU ({} stages)", d.n_stages());
        return Ok(std::sync::Arc::new(dsv4_engine::DeviceProposer(d)));
    }
    let _ = backend;
    Ok(std::sync::Arc::new(dsv4_dspark::Drafter::load_dir(dir)?))
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Checkpoint directory; without it the built-in demo model (random weights) is served.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Sample on the host from each sampled row's logits instead of where the logits are (an
    /// A/B of the device draws: the same tokens but where a draw falls within ~2e-6 of a
    /// boundary of the distribution).
    #[arg(long)]
    host_sampling: bool,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
    /// Ranks to split the model over (tensor + expert parallel, a thread each): in-process
    /// ranks with `--backend cpu`; GPUs 0..N over NCCL with `--backend cuda` (not yet run on
    /// hardware; docs/multi-gpu.md).
    #[arg(long, default_value_t = 1)]
    gpus: usize,
    /// Require this key (`Authorization: Bearer KEY` or `x-api-key: KEY`).
    #[arg(long, env = "DSV4_API_KEY")]
    api_key: Option<String>,
    /// Name served under /v1/models (default: the model directory's name, or `dsv4-demo`).
    #[arg(long)]
    served_model_name: Option<String>,
    /// More names accepted as this model (comma-separated).
    #[arg(long, value_delimiter = ',')]
    model_alias: Vec<String>,
    /// Sequence slots (concurrent sequences holding state).
    #[arg(long, default_value_t = 16)]
    max_seqs: usize,
    /// Tokens per engine step (decode rows + prefill chunks). Default: 512 on the CPU; on a GPU,
    /// what the step's activations fit in 10% of the free memory, 512 to 8192 (long prompts
    /// then prefill in few large chunks).
    #[arg(long)]
    token_budget: Option<usize>,
    /// Longest prompt + completion accepted (default: the model's own maximum, limited to what
    /// the state pool can hold for --max-seqs sequences where the backend knows its memory).
    #[arg(long)]
    max_context: Option<usize>,
    /// `max_tokens` for requests that give none (default: whatever the context leaves).
    #[arg(long)]
    default_max_tokens: Option<usize>,
    /// Largest completion granted to any request; larger `max_tokens` are clamped (finish reason
    /// `length`), like those beyond the context (default: no limit but the context).
    #[arg(long)]
    max_tokens_limit: Option<usize>,
    /// Request fields (a JSON object) added to every request that lacks them, as vLLM's
    /// --override-generation-config: e.g. '{"temperature": 0.6, "top_p": 0.95}'.
    #[arg(long, value_parser = parse_defaults)]
    request_defaults: Option<serde_json::Map<String, serde_json::Value>>,
    /// Answer 404 for model names other than --served-model-name and --model-alias (by
    /// default any name is accepted and echoed back, so agents work with their own names).
    #[arg(long)]
    strict_model_name: bool,
    /// Requests allowed to wait for a slot before new ones get 429.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// Largest request body in MiB.
    #[arg(long, default_value_t = 16)]
    max_body_mb: usize,
    /// Memory for the prefix cache (snapshots of earlier sequences' states), MiB; 0 turns it off.
    #[arg(long, default_value_t = 2048)]
    prefix_cache_mb: usize,
    /// Keep snapshots on disk here too (written on eviction, on shutdown and every
    /// --kv-snapshot-interval tokens of long prompts); found again after a restart.
    #[arg(long)]
    kv_disk_dir: Option<PathBuf>,
    #[arg(long, default_value_t = 8192)]
    kv_disk_budget_mb: usize,
    /// Snapshot long prefills every this many tokens.
    #[arg(long, default_value_t = 4096)]
    kv_snapshot_interval: usize,
    /// Serve random weights at full V4-Flash dimensions with this many layers, drawn on the GPU
    /// (benchmarks only; needs `--features cuda`).
    #[arg(long)]
    synthetic_flash_layers: Option<usize>,
    /// The synthetic weights' layout: bf16, q2 (ds4's IQ2_XXS/Q2_K experts, Q8_0 dense), q4
    /// (Q4_K experts) or official (FP8 + FP4), as `bench --synthetic flash --weights`.
    #[arg(long, default_value = "bf16")]
    synthetic_flash_weights: String,
    /// CUDA: the fast kernels (bf16 activations and cuBLAS for larger batches). They depend on
    /// how many rows share a step, so a sequence's greedy tokens can change with the load; the
    /// default keeps every row's result independent of the batch (f32 activations into every
    /// bf16 product, one kernel path for any batch size), at some throughput cost.
    #[arg(long)]
    cuda_fast: bool,
    #[command(flatten)]
    dspark: DsparkArgs,
    #[command(flatten)]
    guard: GuardArgs,
}

/// Defences against hostile clients (see README, "Security and robustness").
#[derive(clap::Args)]
struct GuardArgs {
    /// More `Host` names a loopback-bound server answers (besides localhost and loopback IPs);
    /// other names are refused (DNS rebinding).
    #[arg(long, value_delimiter = ',')]
    allowed_hosts: Vec<String>,
    /// Web origins allowed to call the API from a browser, with CORS headers (`*`: any). Without
    /// it, requests carrying a non-local `Origin` are refused and no CORS header is sent.
    #[arg(long, value_delimiter = ',')]
    cors_allow_origin: Vec<String>,
    /// `/metrics` requires the API key too.
    #[arg(long)]
    metrics_auth: bool,
    /// Open connections at most; more get a 503 and are closed.
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
    /// Seconds to receive a request's headers (also how long an idle connection is kept).
    #[arg(long, default_value_t = 10)]
    header_timeout_secs: u64,
    /// Seconds to receive a request's body.
    #[arg(long, default_value_t = 30)]
    body_timeout_secs: u64,
}

fn main() {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: log files and journald get plain text.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn serve<B: Ranks>(backend: B, a: ServeArgs) -> Result<()>
where
    Model<B>: Send,
{
    let (dir, default_name) = match &a.model {
        Some(d) => (d.clone(), d.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or("dsv4".into())),
        None => (demo::demo_model_dir()?, "dsv4-demo".to_string()),
    };
    let mut model = load(backend, &dir, a.max_seqs, a.gpus)?;
    let tok = tokenizer_for(&dir)?;
    check_servable(&mut model, &tok)?;
    if a.model.is_none() {
        eprintln!("dsv4: serving the built-in DEMO model (random weights); pass --model DIR for a real checkpoint");
    }
    // Only the disk KV cache needs it; the whole weights are hashed (once per file version).
    let fingerprint = a
        .kv_disk_dir
        .as_ref()
        .map_or(0, |d| dsv4_engine::fingerprint::model_fingerprint(&dir, Some(&d.join(".weight-hashes"))));
    // In the server, DSpark speculates for greedy and sampled requests alike: the engine
    // verifies sampled rounds target-only (each verify row drawn with the uniform of its
    // token's position), so a seeded request's output is exactly its plain run's.
    let dspark = a.dspark.config(&dir, &mut model, true)?;
    serve_model(model, tok, a, default_name, fingerprint, dspark)
}

/// Serves a loaded model until ctrl-c, then writes the prefix cache to disk.
fn serve_model<B: Backend + 'static>(
    mut model: Model<B>,
    tok: dsv4_tokenizer::Tokenizer,
    a: ServeArgs,
    default_name: String,
    fingerprint: u64,
    dspark: Option<SpecConfig>,
) -> Result<()>
where
    Model<B>: Send,
{
    let prefix_cache = (a.prefix_cache_mb > 0 || a.kv_disk_dir.is_some()).then(|| dsv4_engine::PrefixCacheConfig {
        memory_budget: a.prefix_cache_mb << 20,
        disk_dir: a.kv_disk_dir.clone(),
        disk_budget: a.kv_disk_budget_mb << 20,
        fingerprint,
        interval: a.kv_snapshot_interval,
    });
    let max_context = match a.max_context {
        Some(n) => n.min(model.cfg.max_position),
        None => default_max_context(&model, a.max_seqs),
    };
    let speculative = dspark.is_some();
    let token_budget = a.token_budget.unwrap_or_else(|| default_token_budget(&model.cfg, model.memory_free()));
    reserve_states(&mut model, max_context, a.max_seqs);
    let cfg = dsv4_engine::EngineConfig {
        token_budget,
        prefill_chunk: token_budget,
        max_waiting: a.max_waiting,
        max_context,
        prefix_cache,
        dspark,
        host_sampling: a.host_sampling,
    };
    let api_key = dsv4_server::guard::check_api_key(a.api_key)?;
    let addr: std::net::SocketAddr = format!("{}:{}", a.host, a.port).parse().context("--host/--port")?;
    for w in dsv4_server::guard::bind_warnings(&addr, api_key.is_some()) {
        tracing::warn!("{w}");
    }
    let engine = dsv4_engine::spawn(model, cfg, a.max_seqs);
    let g = a.guard;
    let guard = dsv4_server::guard::Guard {
        loopback: addr.ip().is_loopback(),
        allowed_hosts: g.allowed_hosts.iter().map(|h| h.trim().to_ascii_lowercase()).collect(),
        cors_origins: g.cors_allow_origin,
        metrics_auth: g.metrics_auth,
        limits: dsv4_server::guard::Limits {
            max_connections: g.max_connections,
            header_timeout: std::time::Duration::from_secs(g.header_timeout_secs.max(1)),
            body_timeout: std::time::Duration::from_secs(g.body_timeout_secs.max(1)),
        },
        ..Default::default()
    }
    .for_context(&tok, engine.config.max_context);
    let model_name = a.served_model_name.unwrap_or(default_name);
    // What the server runs with, in one place (the flags' effective values).
    tracing::info!(
        "serving `{model_name}` on {addr}: request defaults {}, max-context {max_context}, default-max-tokens {}, max-seqs {}, \
         max-tokens-limit {}, token-budget {}, max-waiting {}, prefix-cache {} MiB{}, DSpark {}, api-key {}, model names {}",
        a.request_defaults.as_ref().map_or("none".to_string(), |d| serde_json::Value::Object(d.clone()).to_string()),
        a.default_max_tokens.map_or("remaining context".to_string(), |n| n.to_string()),
        a.max_seqs,
        a.max_tokens_limit.map_or("none".to_string(), |n| n.to_string()),
        token_budget,
        a.max_waiting,
        a.prefix_cache_mb,
        a.kv_disk_dir.as_ref().map_or(String::new(), |d| format!(" + disk {} ({} MiB)", d.display(), a.kv_disk_budget_mb)),
        if speculative { "on" } else { "off" },
        if api_key.is_some() { "required" } else { "none" },
        if a.strict_model_name { "strict" } else { "any accepted" },
    );
    let state = std::sync::Arc::new(dsv4_server::AppState {
        engine: engine.clone(),
        tok,
        model_name,
        aliases: a.model_alias,
        api_key,
        max_body: a.max_body_mb << 20,
        default_max_tokens: a.default_max_tokens,
        strict_model_name: a.strict_model_name,
        max_tokens_limit: a.max_tokens_limit,
        request_defaults: a.request_defaults.unwrap_or_default(),
        live: Default::default(),
        guard,
    });
    let served = tokio::runtime::Runtime::new()?.block_on(dsv4_server::serve(state, addr));
    // Graceful stop (SIGINT or SIGTERM): the prefix cache goes to disk before the process exits.
    engine.shutdown(std::time::Duration::from_secs(60));
    served?;
    Ok(())
}

/// Refuses checkpoints that load but cannot serve: a tokenizer with ids beyond the model's
/// vocabulary, or weights that give non-finite logits (every request would fail).
fn check_servable<B: Backend>(model: &mut Model<B>, tok: &dsv4_tokenizer::Tokenizer) -> Result<()> {
    let (tv, mv) = (tok.vocab_size(), model.cfg.vocab_size);
    if tv > mv {
        bail!(
            "the tokenizer has {tv} ids but the model's vocabulary has {mv}: wrong tokenizer.json for this checkpoint"
        );
    }
    // A few tokens through every layer: NaN or inf in the weights shows in the logits.
    let probe: Vec<u32> = [tok.special.bos, 100, 2000, 30000].iter().map(|&t| t.min(mv as u32 - 1)).collect();
    let seq = model.alloc_seq()?;
    let logits = model.prefill_chunks(seq, &probe, &[probe.len()]);
    model.free_seq(seq);
    let logits = match logits {
        Err(e @ dsv4_backend::ModelError::NonFinite { .. }) => {
            bail!("the checkpoint gives non-finite values in a probe forward ({e}): its weights hold NaN or inf; refusing to serve it")
        }
        other => other.context("a probe forward of the checkpoint failed")?,
    };
    if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
        bail!(
            "the checkpoint gives non-finite logits (value {} at index {i} of a {}-token probe): its weights hold \
             NaN or inf; refusing to serve it",
            logits[i],
            probe.len()
        );
    }
    Ok(())
}

fn parse_defaults(s: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str(s) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(_) => Err("must be a JSON object".into()),
        Err(e) => Err(format!("invalid JSON: {e}")),
    }
}

/// Bytes of growing state (compressed entries and indexer keys, f32) a sequence holds a token.
fn state_bytes_per_token(cfg: &dsv4_model::Config) -> f64 {
    cfg.layers
        .iter()
        .filter(|l| l.ratio > 0)
        .map(|l| {
            let idx = if l.attn == dsv4_model::config::AttnKind::Csa { cfg.index_head_dim } else { 0 };
            ((cfg.head_dim + idx) * 4) as f64 / l.ratio as f64
        })
        .sum()
}

/// Tokens each of `max_seqs` states can hold in the share `frac` of the backend's free memory;
/// `None` where the backend does not know its memory or the model has no growing state.
fn state_fit<B: Backend>(model: &Model<B>, max_seqs: usize, frac: f64) -> Option<usize> {
    let per_token = state_bytes_per_token(&model.cfg);
    let free = model.memory_free()?;
    (per_token > 0.0).then(|| (free as f64 * frac / (per_token * max_seqs.max(1) as f64)) as usize)
}

/// The share of the free memory the sequences' states may take (reserved at start by
/// [`reserve_states`]); the step's activations ([`default_token_budget`]: 10 %), the recorded
/// steps and the libraries' workspaces need the rest.
const STATE_SHARE: f64 = 0.75;

/// The longest context by default: the model's maximum, or less where the backend knows its
/// free memory and `max_seqs` full-length states (an estimate from the compressed caches,
/// which grow with the sequence) would not fit in [`STATE_SHARE`] of it.
fn default_max_context<B: Backend>(model: &Model<B>, max_seqs: usize) -> usize {
    let max = model.cfg.max_position;
    match state_fit(model, max_seqs, STATE_SHARE) {
        Some(fit) => {
            if fit < max {
                tracing::info!(
                    "max-context {fit}: what {max_seqs} sequences' states fit in free memory (model maximum {max})"
                );
            }
            fit.clamp(1, max)
        }
        None => max,
    }
}

/// Reserves every slot's state for the context limit before the first step (as vLLM
/// preallocates its KV cache), where the backend knows its memory: otherwise the first
/// sequence to pass each power of two reallocates every slot's entries and re-records every
/// recorded step mid-serving. At most [`STATE_SHARE`] of the free memory, what the default
/// context limit is sized to; a `--max-context` beyond that reserves what fits, and longer
/// sequences grow the state as they go (a growth may then run out of memory).
fn reserve_states<B: Backend>(model: &mut Model<B>, max_context: usize, max_seqs: usize) {
    let Some(fit) = state_fit(model, max_seqs, STATE_SHARE) else { return };
    let tokens = max_context.min(fit);
    let gb = state_bytes_per_token(&model.cfg) * (tokens * max_seqs) as f64 / 1e9;
    model.reserve_state(tokens);
    if tokens < max_context {
        tracing::warn!(
            "states reserved for {tokens} tokens × {max_seqs} sequences ({gb:.2} GB, {:.0}% of free memory): \
             longer sequences grow them while serving (max-context {max_context})",
            STATE_SHARE * 100.0
        );
    } else {
        tracing::info!("states reserved for {tokens} tokens × {max_seqs} sequences ({gb:.2} GB)");
    }
}

/// Activation bytes one token of a step holds at its peak, roughly: the mHC streams and their
/// mixes, the routed experts' gate/up/hidden rows, the attention heads' q/output rows and the
/// indexer's queries, all f32, with copies in flight.
fn step_bytes_per_token(cfg: &dsv4_model::Config) -> usize {
    4 * (4 * cfg.hc_mult * cfg.hidden
        + 4 * cfg.n_experts_per_tok * cfg.moe_inter
        + 3 * cfg.n_heads * cfg.head_dim
        + 2 * cfg.index_n_heads * cfg.index_head_dim)
}

/// The default tokens per step: 512 where the backend does not know its memory (the CPU);
/// otherwise what fits in 10% of the free memory (the states may take [`STATE_SHARE`], see
/// [`default_max_context`]), between 512 and 8192.
fn default_token_budget(cfg: &dsv4_model::Config, free: Option<u64>) -> usize {
    match free {
        Some(f) => ((f / 10) as usize / step_bytes_per_token(cfg)).clamp(512, 8192),
        None => 512,
    }
}

/// `serve --synthetic-flash-layers N`: random weights at full V4-Flash dimensions drawn on the
/// GPU (no checkpoint), for serving benchmarks.
#[cfg(feature = "cuda")]
fn serve_flash(a: ServeArgs, layers: usize) -> Result<()> {
    use dsv4_backend::cuda::CudaBackend;
    let scheme = a.synthetic_flash_weights.clone();
    flash_bench::check_scheme(&scheme, "--synthetic-flash-weights")?;
    let cfg = flash_bench::flash_layers(layers);
    let b = CudaBackend::new(0).context("starting the CUDA backend")?;
    b.set_exact(!a.cuda_fast);
    let (w, _) = flash_bench::draw_weights(&b, &cfg, &scheme);
    let model = Model::new(b, cfg, w, a.max_seqs);
    eprintln!("dsv4: serving SYNTHETIC V4-Flash weights ({layers} layers, {scheme}, random) for benchmarks");
    let name = format!("synthetic-flash-{layers}l-{scheme}");
    serve_model(model, dsv4_tokenizer::Tokenizer::deepseek_v4()?, a, name, 0, None)
}

#[cfg(not(feature = "cuda"))]
fn serve_flash(_a: ServeArgs, _layers: usize) -> Result<()> {
    bail!("--synthetic-flash-layers draws full-size weights on the GPU: rebuild with `--features cuda`")
}

/// A backend that can open the backends of more ranks (`--gpus N`) and join them.
pub(crate) trait Ranks: Backend + Sized + 'static {
    /// The backend of rank `r` (r ≥ 1), configured as `self`.
    fn for_rank(&self, r: usize) -> Result<Self>;
    /// One communicator per rank.
    fn comms(backends: &[Self]) -> Result<Vec<Box<dyn Comm<Self>>>>;
}

impl Ranks for CpuBackend {
    fn for_rank(&self, _r: usize) -> Result<Self> {
        Ok(CpuBackend)
    }
    fn comms(backends: &[Self]) -> Result<Vec<Box<dyn Comm<Self>>>> {
        Ok(dsv4_backend::comm::LocalComm::boxed(backends.len()))
    }
}

#[cfg(feature = "cuda")]
impl Ranks for dsv4_backend::cuda::CudaBackend {
    fn for_rank(&self, r: usize) -> Result<Self> {
        let b = Self::new(r).with_context(|| format!("starting the CUDA backend on GPU {r}"))?;
        b.set_exact(self.exact());
        Ok(b)
    }
    /// NCCL, a communicator per GPU on its backend's stream (not yet run on hardware).
    fn comms(backends: &[Self]) -> Result<Vec<Box<dyn Comm<Self>>>> {
        let refs: Vec<&Self> = backends.iter().collect();
        let comms = dsv4_backend::cuda::nccl::NcclComm::group(&refs)?;
        Ok(comms.into_iter().map(|c| Box::new(c) as Box<dyn Comm<Self>>).collect())
    }
}

/// Loads `dir` on one rank, or split over `gpus` ranks driven as one model.
pub(crate) fn load<B: Ranks>(backend: B, dir: &std::path::Path, max_seqs: usize, gpus: usize) -> Result<Model<B>>
where
    Model<B>: Send,
{
    let ctx = || format!("loading {}", dir.display());
    match gpus {
        0 => bail!("--gpus must be at least 1"),
        1 => Model::load(backend, dir, max_seqs, true).with_context(ctx),
        n => {
            if !backend.expert_parallel() {
                bail!(dsv4_backend::ModelError::NoExpertParallel(backend.name()));
            }
            let mut backends = vec![];
            for r in 1..n {
                backends.push(backend.for_rank(r)?);
            }
            backends.insert(0, backend);
            let comms = B::comms(&backends)?;
            let m = Model::load_group(backends, comms, dir, max_seqs, true).with_context(ctx)?;
            tracing::info!("split over {n} ranks (tensor + expert parallel)");
            Ok(m)
        }
    }
}

fn tokenizer_for(dir: &std::path::Path) -> Result<dsv4_tokenizer::Tokenizer> {
    // `--model X.gguf`: look next to the file.
    let dir = if dir.is_file() { dir.parent().unwrap_or(std::path::Path::new(".")) } else { dir };
    let local = dir.join("tokenizer.json");
    Ok(if local.exists() {
        dsv4_tokenizer::Tokenizer::from_file(&local)?
    } else {
        tracing::warn!(
            "{} has no tokenizer.json: using the embedded DeepSeek V4 tokenizer; if this checkpoint has another \
             vocabulary its text will be wrong",
            dir.display()
        );
        dsv4_tokenizer::Tokenizer::deepseek_v4()?
    })
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Logits(a) => with_backend!(a.backend, logits(a))?,
        Cmd::Generate(a) => with_backend!(a.backend, generate_cmd(a))?,
        Cmd::InitTiny { out, seed } => {
            demo::init_tiny(&out, seed)?;
            eprintln!("wrote a random tiny DeepSeek V4 checkpoint to {}", out.display());
        }
        Cmd::Quantize(a) => quantize::run(a)?,
        Cmd::Inspect(a) => quantize::inspect(a)?,
        Cmd::CompileKernels => compile_kernels()?,
        Cmd::Bench(a) if a.synthetic == "flash" => flash(a)?,
        Cmd::Bench(a) if a.synthetic == "kernels" => kernels(a)?,
        Cmd::Bench(a) if a.synthetic == "sampler" => bench::sampler()?,
        Cmd::Bench(a) => with_backend!(a.backend, bench_run(a))?,
        Cmd::Debug(c) => {
            if !debug::run(c)? {
                std::process::exit(1);
            }
        }
        Cmd::Serve(a) => match (a.synthetic_flash_layers, a.backend) {
            (Some(n), _) => serve_flash(a, n)?,
            #[cfg(feature = "cuda")]
            (None, BackendKind::Cuda) => {
                let b = dsv4_backend::cuda::CudaBackend::new(0).context("starting the CUDA backend")?;
                b.set_exact(!a.cuda_fast);
                serve(b, a)?
            }
            _ => with_backend!(a.backend, serve(a))?,
        },
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn compile_kernels() -> Result<()> {
    let files = dsv4_backend::cuda::keep_kernels().context("compiling the CUDA kernels")?;
    eprintln!("kept the PTX of {} in the kernel cache", files.join(", "));
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn compile_kernels() -> Result<()> {
    bail!("this dsv4 was built without CUDA; rebuild with `--features cuda`")
}

#[cfg(feature = "cuda")]
fn flash(a: bench::BenchArgs) -> Result<()> {
    if !matches!(a.backend, BackendKind::Cuda) {
        bail!("--synthetic flash draws full-size weights on the GPU: use --backend cuda");
    }
    flash_bench::run(a)
}

#[cfg(not(feature = "cuda"))]
fn flash(_a: bench::BenchArgs) -> Result<()> {
    bail!("--synthetic flash needs the CUDA backend; rebuild with `--features cuda` and pass --backend cuda")
}

#[cfg(feature = "cuda")]
fn kernels(a: bench::BenchArgs) -> Result<()> {
    if !matches!(a.backend, BackendKind::Cuda) {
        bail!("--synthetic kernels times the CUDA kernels: use --backend cuda");
    }
    kernel_bench::run(&a.tables)
}

#[cfg(not(feature = "cuda"))]
fn kernels(_a: bench::BenchArgs) -> Result<()> {
    bail!("--synthetic kernels needs the CUDA backend; rebuild with `--features cuda` and pass --backend cuda")
}

fn bench_run<B: Ranks>(backend: B, a: bench::BenchArgs) -> Result<()>
where
    Model<B>: Send,
{
    bench::run(backend, a)
}

fn logits<B: Ranks>(backend: B, a: LogitsArgs) -> Result<()>
where
    Model<B>: Send,
{
    let toks = parse_tokens(&a.tokens)?;
    if toks.is_empty() {
        bail!("--tokens is empty");
    }
    let chunks = match a.chunks {
        Some(c) => parse_list(&c).context("--chunks")?,
        None => vec![toks.len()],
    };
    let sum: usize = chunks.iter().sum();
    if sum != toks.len() {
        bail!("--chunks {chunks:?} sum to {sum}, but --tokens has {} ids", toks.len());
    }
    let mut m = load(backend, &a.model, 1, a.gpus)?;
    let seq = m.alloc_seq()?;
    let logits = m.prefill_chunks(seq, &toks, &chunks)?;
    write_npy(&a.out, &logits, toks.len(), m.cfg.vocab_size)?;
    eprintln!("wrote {} [{} x {}]", a.out.display(), toks.len(), m.cfg.vocab_size);
    Ok(())
}

fn generate_cmd<B: Ranks>(backend: B, a: GenerateArgs) -> Result<()>
where
    Model<B>: Send,
{
    let dir = match a.model {
        Some(d) => d,
        None => demo::demo_model_dir()?,
    };
    let mut m = load(backend, &dir, 1, a.gpus)?;
    let tok = tokenizer_for(&dir)?;
    let ids = match (a.prompt, a.tokens) {
        (Some(p), None) => tok.encode(&p, true)?,
        (None, Some(t)) => parse_tokens(&t)?,
        _ => bail!("give --prompt TEXT or --tokens IDS"),
    };
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= m.cfg.vocab_size) {
        bail!("token id {bad} is outside the model's vocabulary (size {})", m.cfg.vocab_size);
    }
    let (temperature, top_p, top_k, min_p, seed) = (a.temperature, a.top_p, a.top_k, a.min_p, a.seed);
    let mut sampler = Sampler::new(SamplingParams { temperature, top_p, top_k, min_p, seed })?;
    let stop: Vec<u32> = if a.ignore_eos { Vec::new() } else { m.cfg.eos_token_ids.clone() };
    let chunk = a.prefill_chunk.unwrap_or_else(|| default_token_budget(&m.cfg, m.memory_free()));
    let opts = GenerateOptions { max_new_tokens: a.max_new_tokens, stop_ids: &stop, prefill_chunk: chunk };
    let spec = a.dspark.config(&dir, &mut m, true)?;
    let (g, stats) = match &spec {
        Some(sc) => {
            let (g, st) = generate_speculative(&mut m, &ids, &mut sampler, &opts, sc)?;
            (g, Some(st))
        }
        None => (generate(&mut m, &ids, &mut sampler, &opts)?, None),
    };
    let text = tok.decode(&g.tokens, true)?;
    if a.json {
        let mut out = serde_json::json!({
            "tokens": g.tokens,
            "text": text,
            "prompt_tokens": ids.len(),
            "margins": g.margins,
            "finish_reason": if g.stop == StopReason::Eos { "stop" } else { "length" },
            "prefill_tokens_per_s": ids.len() as f64 / g.prefill_secs.max(1e-9),
            "decode_tokens_per_s": g.tokens.len().saturating_sub(1) as f64 / g.decode_secs.max(1e-9),
        });
        if let Some(st) = stats {
            out["dspark"] = st.to_json();
        }
        println!("{out}");
    } else {
        println!("{text}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_budget_follows_free_memory() {
        let cfg = dsv4_model::Config::flash();
        // About 0.9 MB a token at V4-Flash's dimensions.
        let per = step_bytes_per_token(&cfg);
        assert!((500_000..1_500_000).contains(&per), "{per} bytes a token");
        assert_eq!(default_token_budget(&cfg, None), 512);
        assert_eq!(default_token_budget(&cfg, Some(1 << 30)), 512);
        let mid = default_token_budget(&cfg, Some(40_000_000_000));
        assert!((2048..8192).contains(&mid), "40 GB free: {mid}");
        assert_eq!(default_token_budget(&cfg, Some(1 << 40)), 8192);
    }
}
