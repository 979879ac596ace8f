//! Prefix cache: restored sequences continue exactly like cold ones; snapshots survive on disk;
//! bad snapshot files are ignored and never produce a token.

use dsv4_backend::cpu::CpuBackend;
use dsv4_backend::Model;
use dsv4_engine::disk_cache::{encode, DiskCache, MAGIC};
use dsv4_engine::{spawn, EngineConfig, EngineHandle, Event, Metrics, PrefixCacheConfig, Request, SamplingParams};
use dsv4_model::store::write_safetensors;
use dsv4_model::synth::{random_checkpoint, tiny_config, SynthDType};
use std::path::Path;

fn model_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(97);
    cfg.max_position = 4096;
    std::fs::write(d.path().join("config.json"), cfg.to_hf_json().to_string()).unwrap();
    write_safetensors(&d.path().join("model.safetensors"), &random_checkpoint(&cfg, 11, SynthDType::F32)).unwrap();
    d
}

fn engine(dir: &Path, disk: Option<&Path>, fingerprint: u64, cache: bool) -> EngineHandle {
    let m = Model::load(CpuBackend, dir, 4, false).unwrap();
    let prefix_cache = cache.then(|| PrefixCacheConfig {
        memory_budget: 64 << 20,
        disk_dir: disk.map(Path::to_path_buf),
        disk_budget: 64 << 20,
        fingerprint,
        interval: 16,
    });
    spawn(m, EngineConfig { token_budget: 64, prefill_chunk: 32, prefix_cache, ..Default::default() }, 4)
}

/// Runs a greedy request; returns (tokens, cached prompt tokens).
fn run(h: &EngineHandle, prompt: &[u32], n: usize) -> (Vec<u32>, usize) {
    let req = Request {
        prompt: prompt.to_vec(),
        sampling: SamplingParams::default(),
        max_tokens: n,
        stop_ids: vec![],
        top_logprobs: None,
        snapshot_at: vec![prompt.len() - 1],
        logits: Default::default(),
    };
    let mut sub = h.submit(req).unwrap();
    let mut toks = Vec::new();
    loop {
        match sub.events.blocking_recv().unwrap() {
            Event::Token(t) => toks.push(t.id),
            Event::Done { cached_tokens, .. } => return (toks, cached_tokens),
            Event::Error(e) => panic!("{e}"),
        }
    }
}

fn turns() -> Vec<Vec<u32>> {
    // Each turn resends the conversation so far plus new tokens (lengths not multiples of 4 or 8).
    let mut conv: Vec<u32> = (0..37).map(|i| (i * 7 % 97) as u32).collect();
    let mut out = vec![conv.clone()];
    for t in 0..4 {
        conv.extend((0..(13 + 5 * t)).map(|i| ((i * 11 + t * 3) % 97) as u32));
        out.push(conv.clone());
    }
    out
}

#[test]
fn warm_turns_prefill_only_new_tokens_and_match_cold_runs() {
    let dir = model_dir();
    let cold = engine(dir.path(), None, 1, false);
    let warm = engine(dir.path(), None, 1, true);
    let ts = turns();
    for (i, p) in ts.iter().enumerate() {
        let (want, c0) = run(&cold, p, 6);
        let (got, cached) = run(&warm, p, 6);
        assert_eq!(c0, 0);
        assert_eq!(got, want, "turn {i}");
        if i > 0 {
            // Everything the previous turn's prompt held is reused: only new tokens are prefilled.
            assert_eq!(cached, ts[i - 1].len(), "turn {i}");
        }
    }
    assert_eq!(Metrics::get(&warm.metrics.prefix_hits), 4);
}

#[test]
fn snapshots_survive_a_restart_on_disk() {
    let dir = model_dir();
    let disk = tempfile::tempdir().unwrap();
    let ts = turns();
    let cold = engine(dir.path(), None, 1, false);
    let (want, _) = run(&cold, &ts[1], 5);
    {
        let a = engine(dir.path(), Some(disk.path()), 7, true);
        run(&a, &ts[0], 5);
        a.shutdown(std::time::Duration::from_secs(30));
    }
    let files = std::fs::read_dir(disk.path()).unwrap().count();
    assert!(files >= 1, "nothing written to disk");
    let b = engine(dir.path(), Some(disk.path()), 7, true);
    let (got, cached) = run(&b, &ts[1], 5);
    assert_eq!(got, want);
    assert_eq!(cached, ts[0].len());
    // Another model's engine (other fingerprint) ignores them.
    let c = engine(dir.path(), Some(disk.path()), 8, true);
    let (got, cached) = run(&c, &ts[1], 5);
    assert_eq!((got, cached), (want, 0));
}

#[test]
fn bad_snapshot_files_are_ignored() {
    let dir = model_dir();
    let m = Model::load(CpuBackend, dir.path(), 1, false).unwrap();
    let cfg = m.cfg.clone();
    let mut m = m;
    let ts = turns();
    let s = m.alloc_seq().unwrap();
    m.prefill_chunks(s, &ts[0], &[ts[0].len()]).unwrap();
    let snap = m.snapshot(s).unwrap();
    let good = encode(&ts[0], &snap, 5);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("truncated", good[..good.len() - 100].to_vec()),
        ("bitflip", {
            let mut b = good.clone();
            let k = b.len() / 2;
            b[k] ^= 0x10;
            b
        }),
        ("other-model", encode(&ts[0], &snap, 6)),
        ("other-version", {
            let mut b = good.clone();
            b[8] = 99;
            b
        }),
        ("not-magic", {
            let mut b = good.clone();
            b[..8].copy_from_slice(b"NOTDSV4!");
            b
        }),
    ];
    assert_eq!(&good[..8], MAGIC);
    for (name, bytes) in cases {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(format!("{name}.dsv4kv")), &bytes).unwrap();
        // A write killed before its rename leaves only a temporary file.
        std::fs::write(d.path().join(".tmp-999-0"), &good[..good.len() / 2]).unwrap();
        let mut dc = DiskCache::open(d.path(), 1 << 30, 5, &cfg).unwrap();
        let h = dsv4_engine::prefix_cache::prefix_hashes(&ts[1]);
        assert!(dc.lookup(&ts[1], &h, 0).is_none(), "{name} was used");
        assert!(dc.rejected >= 1, "{name} not reported");
        assert!(!d.path().join(".tmp-999-0").exists(), "temporary file left behind");
        // The engine with that directory runs cold, correctly.
        let e = engine(dir.path(), Some(d.path()), 5, true);
        let (_, cached) = run(&e, &ts[1], 3);
        assert_eq!(cached, 0, "{name}");
    }
    // The intact file is used.
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("good.dsv4kv"), &good).unwrap();
    let mut dc = DiskCache::open(d.path(), 1 << 30, 5, &cfg).unwrap();
    let h = dsv4_engine::prefix_cache::prefix_hashes(&ts[1]);
    let (toks, back) = dc.lookup(&ts[1], &h, 0).unwrap();
    assert_eq!((toks, back), (ts[0].clone(), snap));
}

/// Under a small memory budget the least recently used snapshots are evicted, spilled to disk,
/// and found again there.
#[test]
fn eviction_spills_to_disk_and_lookups_find_it_again() {
    use dsv4_engine::prefix_cache::PrefixCache;
    let dir = model_dir();
    let disk = tempfile::tempdir().unwrap();
    let mut m = Model::load(CpuBackend, dir.path(), 1, false).unwrap();
    let ts = turns();
    let s = m.alloc_seq().unwrap();
    let mut snaps = Vec::new();
    let mut fed = 0;
    for t in &ts {
        m.prefill_chunks(s, &t[fed..], &[t.len() - fed]).unwrap();
        fed = t.len();
        snaps.push(m.snapshot(s).unwrap());
    }
    let one = snaps[0].state.size_bytes();
    let cfg = PrefixCacheConfig {
        memory_budget: one * 2, // room for about two snapshots
        disk_dir: Some(disk.path().to_path_buf()),
        disk_budget: 1 << 30,
        fingerprint: 3,
        interval: 0,
    };
    let mut pc = PrefixCache::new(cfg, &m.cfg);
    for (t, snap) in ts.iter().zip(snaps) {
        pc.insert(t, snap);
    }
    assert!(pc.len() < ts.len(), "nothing was evicted");
    assert!(pc.memory_bytes() <= one * 2 + 4 * ts[4].len());
    let on_disk = std::fs::read_dir(disk.path()).unwrap().count();
    assert_eq!(on_disk + pc.len(), ts.len(), "evicted snapshots were not spilled");
    // The oldest (evicted) prefix is still found, now from disk.
    let mut q = ts[0].clone();
    q.push(5);
    let hit = pc.lookup(&q).expect("found on disk");
    assert_eq!(hit.len, ts[0].len());
}

/// Long prompts are snapshotted to disk at every interval while they prefill, before any
/// eviction or shutdown.
#[test]
fn interval_snapshots_reach_disk_immediately() {
    let dir = model_dir();
    let disk = tempfile::tempdir().unwrap();
    let h = engine(dir.path(), Some(disk.path()), 4, true); // interval 16
    let prompt: Vec<u32> = (0..70).map(|i| (i * 13 % 97) as u32).collect();
    run(&h, &prompt, 2);
    let files = std::fs::read_dir(disk.path())
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "dsv4kv"));
    // Positions 16, 32, 48 and 64 of the 70-token prompt.
    assert_eq!(files.count(), 4);
}
