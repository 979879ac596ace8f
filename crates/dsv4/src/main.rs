//! `dsv4`: the DeepSeek V4 engine's command line.

mod bench;
mod cli_util;
mod demo;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use cli_util::{parse_list, parse_tokens, write_npy};
use dsv4_backend::cpu::CpuBackend;
use dsv4_backend::Model;
use dsv4_engine::{generate, GenerateOptions, Sampler, SamplingParams, StopReason};
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
}

#[derive(Subcommand)]
enum Cmd {
    /// Logits at every input position, fed in the given chunks, as a float32 .npy [T, vocab].
    Logits {
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
        #[arg(long)]
        out: PathBuf,
    },
    /// Generate a continuation (greedy when --temperature is 0).
    Generate {
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
        /// Longest prefill chunk.
        #[arg(long, default_value_t = 512)]
        prefill_chunk: usize,
        #[arg(long, value_enum, default_value = "cpu")]
        backend: BackendKind,
        /// Print {"tokens":[...],"text":"...",...} instead of the text.
        #[arg(long)]
        json: bool,
    },
    /// Write a small random DeepSeek V4 checkpoint with every layer type.
    InitTiny {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Measure prefill and decode speed.
    Bench(bench::BenchArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn load_cpu(dir: &std::path::Path, max_seqs: usize) -> Result<Model<CpuBackend>> {
    Model::load(CpuBackend, dir, max_seqs, true).with_context(|| format!("loading {}", dir.display()))
}

fn tokenizer_for(dir: &std::path::Path) -> Result<dsv4_tokenizer::Tokenizer> {
    let local = dir.join("tokenizer.json");
    Ok(if local.exists() {
        dsv4_tokenizer::Tokenizer::from_file(&local)?
    } else {
        dsv4_tokenizer::Tokenizer::deepseek_v4()?
    })
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Logits { model, tokens, chunks, backend: BackendKind::Cpu, out } => {
            let toks = parse_tokens(&tokens)?;
            if toks.is_empty() {
                bail!("--tokens is empty");
            }
            let chunks = match chunks {
                Some(c) => parse_list(&c).context("--chunks")?,
                None => vec![toks.len()],
            };
            let sum: usize = chunks.iter().sum();
            if sum != toks.len() {
                bail!("--chunks {chunks:?} sum to {sum}, but --tokens has {} ids", toks.len());
            }
            let mut m = load_cpu(&model, 1)?;
            let seq = m.alloc_seq()?;
            let logits = m.prefill_chunks(seq, &toks, &chunks)?;
            write_npy(&out, &logits, toks.len(), m.cfg.vocab_size)?;
            eprintln!("wrote {} [{} x {}]", out.display(), toks.len(), m.cfg.vocab_size);
        }
        Cmd::Generate {
            model,
            prompt,
            tokens,
            max_new_tokens,
            temperature,
            top_p,
            top_k,
            min_p,
            seed,
            ignore_eos,
            prefill_chunk,
            backend: BackendKind::Cpu,
            json,
        } => {
            let dir = match model {
                Some(d) => d,
                None => demo::demo_model_dir()?,
            };
            let mut m = load_cpu(&dir, 1)?;
            let tok = tokenizer_for(&dir)?;
            let ids = match (prompt, tokens) {
                (Some(p), None) => tok.encode(&p, true)?,
                (None, Some(t)) => parse_tokens(&t)?,
                _ => bail!("give --prompt TEXT or --tokens IDS"),
            };
            if let Some(&bad) = ids.iter().find(|&&t| t as usize >= m.cfg.vocab_size) {
                bail!("token id {bad} is outside the model's vocabulary (size {})", m.cfg.vocab_size);
            }
            let mut sampler = Sampler::new(SamplingParams { temperature, top_p, top_k, min_p, seed })?;
            let stop: Vec<u32> = if ignore_eos { Vec::new() } else { m.cfg.eos_token_ids.clone() };
            let g = generate(
                &mut m,
                &ids,
                &mut sampler,
                &GenerateOptions { max_new_tokens, stop_ids: &stop, prefill_chunk },
            )?;
            let text = tok.decode(&g.tokens, true)?;
            if json {
                let out = serde_json::json!({
                    "tokens": g.tokens,
                    "text": text,
                    "prompt_tokens": ids.len(),
                    "margins": g.margins,
                    "finish_reason": if g.stop == StopReason::Eos { "stop" } else { "length" },
                    "prefill_tokens_per_s": ids.len() as f64 / g.prefill_secs.max(1e-9),
                    "decode_tokens_per_s": g.tokens.len().saturating_sub(1) as f64 / g.decode_secs.max(1e-9),
                });
                println!("{out}");
            } else {
                println!("{text}");
            }
        }
        Cmd::InitTiny { out, seed } => {
            demo::init_tiny(&out, seed)?;
            eprintln!("wrote a random tiny DeepSeek V4 checkpoint to {}", out.display());
        }
        Cmd::Bench(args) => bench::run(args)?,
    }
    Ok(())
}
