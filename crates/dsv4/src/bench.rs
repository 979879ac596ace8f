//! `dsv4 bench`: prefill and decode throughput on a checkpoint or a synthetic model.

use anyhow::{bail, Result};
use dsv4_backend::{Batch, Model};
use dsv4_model::store::write_safetensors;
use dsv4_model::synth::{random_checkpoint, tiny_config, SynthDType};
use dsv4_model::{AttnKind, Config, LayerSpec};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Checkpoint directory (otherwise --synthetic).
    #[arg(long)]
    model: Option<PathBuf>,
    /// A random model: `tiny` (spec §12.1 dimensions), `mid` (hidden 1024, 8 layers), or
    /// `flash` (full V4-Flash dimensions, `--layers` of them, drawn on the GPU; `--backend cuda`),
    /// or `kernels` (each weight format's product kernel alone: check and GB/s; `--backend cuda`),
    /// or `sampler` (the host sampler alone over V4's vocabulary).
    #[arg(long, default_value = "tiny")]
    pub synthetic: String,
    /// `--synthetic flash`: decoder layers (SWA, then CSA/HCA alternating).
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// `--synthetic flash`: prefill contexts to time (comma-separated).
    #[arg(long, default_value = "1024,8192,32768")]
    pub contexts: String,
    /// `--synthetic flash`: decode batch sizes to time (comma-separated).
    #[arg(long, default_value = "1,16,64")]
    pub decode_batches: String,
    /// `--synthetic flash`, CUDA: time each decode batch with the decode fusions off and on
    /// (`0,1`; `CudaBackend::set_decode_fusions`) in one process, one weight draw for both;
    /// empty: as the environment set them at start.
    #[arg(long, default_value = "")]
    pub decode_fusions: String,
    /// `--synthetic flash`: context each decode sequence holds before timing.
    #[arg(long, default_value_t = 4096)]
    pub decode_context: usize,
    /// `--synthetic flash`: how the decode sequences get their context: `prefill` (each its own
    /// prompt) or `clone` (the first is prefilled, the others restored from its snapshot: the
    /// same state bytes to read a step, and batch 64 at 4096 in seconds instead of minutes).
    #[arg(long, default_value = "prefill", value_parser = ["prefill", "clone"])]
    pub decode_fill: String,
    /// `--synthetic flash`: decode and verify steps bring every row's f32 logits to the host
    /// (what a batch with sampled rows needs). Without it a step returns each row's greedy id
    /// (argmax on the device), as `serve` runs greedy rows: the logits of 64 rows are 33 MB a
    /// step to copy.
    #[arg(long)]
    pub step_logits: bool,
    /// `--synthetic flash`: decode steps draw every row's token on the device at temperature
    /// 0.7 and top-p 0.95 (a sampled request without a host pass, as `serve` runs it: only ids
    /// cross), instead of its greedy argmax.
    #[arg(long)]
    pub step_sample: bool,
    #[arg(long, default_value_t = 512)]
    pub prompt_len: usize,
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// `--synthetic flash`: also time speculative verify rounds (a forward of 1 + l rows per
    /// sequence, then the cut back) for these draft lengths l (comma-separated).
    #[arg(long, default_value = "")]
    pub verify_drafts: String,
    /// `--synthetic flash`: time a full DSpark round on the GPU: a synthetic V4-Flash drafter
    /// (3 stages, γ = 5, Markov rank 256) drawn on the device drafts for every decode batch
    /// (one batched forward), its rings take the committed rows, and the verify of 1 + l rows
    /// (l from --verify-drafts, default 1,2,3,4) completes the round.
    #[arg(long)]
    pub dspark_round: bool,
    /// `--dspark-round`: the synthetic drafter's weight layout (as `--weights`); empty: the
    /// target's. ds4's DSpark GGUF for V4-Flash is ~5.6 GiB (3 stages with quantised experts),
    /// where the drafter drawn in bf16 is 42.8 GB.
    #[arg(long, default_value = "")]
    pub dspark_weights: String,
    /// `--synthetic kernels`: the tables to run (comma-separated: products, int8, tiles, draws,
    /// experts, chain, onerow, stages), or all.
    #[arg(long, default_value = "all")]
    pub tables: String,
    /// Longest prefill chunk.
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// `--synthetic flash`: no warm-up before the first prefill context, so that its figure is
    /// the cold time to first token of a server that just loaded its weights (the kernels'
    /// first launches, cuBLAS's first algorithm choices, the memory pool's first growth).
    #[arg(long)]
    pub cold: bool,
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: crate::BackendKind,
    /// Ranks to split a checkpoint or `--synthetic tiny|mid` over (tensor + expert parallel, a
    /// thread each; see `dsv4 generate --help`).
    #[arg(long, default_value_t = 1)]
    pub gpus: usize,
    /// Weight formats of `--synthetic flash` on CUDA: `bf16`; `q2` or `q4` (ds4's GGUF policy:
    /// routed experts IQ2_XXS gate/up + Q2_K down, or Q4_K; attention projections, shared
    /// experts and head Q8_0; compressors, indexers, embedding bf16); `official` (FP4 routed
    /// experts, FP8 projections and shared experts, bf16 head and embedding).
    #[arg(long, default_value = "bf16")]
    pub weights: String,
    /// Before decoding, reserve compressed-KV state for `SEQSxTOKENS` (e.g. `4x32768`) and
    /// report the device memory in use.
    #[arg(long, default_value = "")]
    pub reserve: String,
    /// CUDA: exact mode, what `dsv4 serve` runs unless `--cuda-fast` (f32 activations into bf16
    /// products, one kernel path at any batch), so a serving run compares with the same kernels.
    #[arg(long)]
    pub cuda_exact: bool,
}

/// Hidden 1024, 8 layers (2 SWA, then CSA 4 / HCA 128), 16 heads of 128, 32 experts top-4.
pub fn mid_config() -> Config {
    let mut c = tiny_config(129280);
    c.hidden = 1024;
    c.n_heads = 16;
    c.head_dim = 128;
    c.rope_dim = 64;
    c.q_lora_rank = 256;
    c.o_groups = 4;
    c.o_lora_rank = 256;
    c.window = 128;
    c.index_n_heads = 8;
    c.index_head_dim = 64;
    c.index_topk = 64;
    c.n_routed_experts = 32;
    c.n_experts_per_tok = 4;
    c.moe_inter = 256;
    c.swiglu_limit = 10.0;
    c.yarn = Some(dsv4_model::Yarn { factor: 16.0, original_max_position: 65536.0, beta_fast: 32.0, beta_slow: 1.0 });
    c.layers = (0..8)
        .map(|i| {
            let (attn, ratio) = match i {
                0 | 1 => (AttnKind::Swa, 0),
                i if i % 2 == 0 => (AttnKind::Csa, 4),
                _ => (AttnKind::Hca, 128),
            };
            LayerSpec { attn, ratio, hash_moe: i < 3 }
        })
        .collect();
    c
}

pub fn run<B: crate::Ranks>(backend: B, a: BenchArgs) -> Result<()>
where
    Model<B>: Send,
{
    let _tmp;
    let (dir, label) = match &a.model {
        Some(d) => (d.clone(), d.display().to_string()),
        None => {
            let cfg = match a.synthetic.as_str() {
                "tiny" => tiny_config(129280),
                "mid" => mid_config(),
                other => bail!("unknown --synthetic `{other}` (tiny, mid or flash)"),
            };
            _tmp = tempfile::tempdir()?;
            std::fs::write(_tmp.path().join("config.json"), serde_json::to_string(&cfg.to_hf_json())?)?;
            write_safetensors(&_tmp.path().join("model.safetensors"), &random_checkpoint(&cfg, 1, SynthDType::BF16))?;
            (_tmp.path().to_path_buf(), format!("synthetic-{}", a.synthetic))
        }
    };
    let name = backend.name();
    let mut m = crate::load(backend, &dir, 1, a.gpus)?;
    let vocab = m.cfg.vocab_size as u64;
    let toks: Vec<u32> = (0..a.prompt_len as u64).map(|i| ((i * 2654435761) % vocab) as u32).collect();
    let seq = m.alloc_seq()?;
    let t0 = Instant::now();
    let mut last = 0;
    for (i, c) in toks.chunks(a.prefill_chunk.max(1)).enumerate() {
        let logits = m.forward(&Batch::chunk(seq, i * a.prefill_chunk.max(1), c)?, &[c.len() - 1])?;
        last = dsv4_engine::sampler::argmax_margin(&logits).0;
    }
    let prefill = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for i in 0..a.decode_tokens {
        let logits = m.forward(&Batch::chunk(seq, a.prompt_len + i, &[last])?, &[0])?;
        last = dsv4_engine::sampler::argmax_margin(&logits).0;
    }
    let decode = t1.elapsed().as_secs_f64();
    let threads = rayon::current_num_threads();
    println!(
        "{}",
        serde_json::json!({
            "model": label, "backend": name, "threads": threads,
            "hidden": m.cfg.hidden, "layers": m.cfg.n_layers(), "vocab": m.cfg.vocab_size,
            "prompt_len": a.prompt_len, "prefill_chunk": a.prefill_chunk,
            "prefill_tokens_per_s": a.prompt_len as f64 / prefill,
            "decode_tokens": a.decode_tokens, "decode_context": a.prompt_len,
            "decode_tokens_per_s": a.decode_tokens as f64 / decode,
        })
    );
    Ok(())
}

/// `dsv4 bench --synthetic sampler`: one draw of the host sampler over a V4-size vocabulary of
/// random logits, per sampling setting (what a row that needs its logits costs the engine's
/// thread each step).
pub fn sampler() -> Result<()> {
    use dsv4_engine::sampler::{Sampler, SamplingParams};
    let v = 129_280;
    let mut s = 1u64;
    let logits: Vec<f32> = (0..v)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / 16_777_216.0 - 0.5) * 20.0
        })
        .collect();
    let settings = [
        ("greedy", SamplingParams::default()),
        ("temperature 1", SamplingParams { temperature: 1.0, seed: 1, ..Default::default() }),
        (
            "temperature 0.7, top-p 0.95",
            SamplingParams { temperature: 0.7, top_p: 0.95, seed: 1, ..Default::default() },
        ),
        ("temperature 0.7, top-k 40", SamplingParams { temperature: 0.7, top_k: 40, seed: 1, ..Default::default() }),
        ("temperature 1, min-p 0.05", SamplingParams { temperature: 1.0, min_p: 0.05, seed: 1, ..Default::default() }),
    ];
    let mut out = Vec::new();
    for (name, p) in settings {
        let mut sm = Sampler::new(p)?;
        let reps = 50;
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            sm.sample(&logits)?;
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3 / reps as f64;
        println!("sampler, {v} logits, {name}: {ms:.3} ms a draw");
        out.push(serde_json::json!({"setting": name, "ms_per_draw": ms}));
    }
    println!("{}", serde_json::json!({"vocab": v, "sampler": out}));
    Ok(())
}
