//! What hostile inputs must not do to the engine: a forged snapshot that passes its checksum
//! never reaches the forward, odd files in the cache directory neither hang nor stay behind, a
//! panic inside a step fails that step's requests and the engine goes on, and the waiting limit
//! holds under concurrent submits.

use dsv4_backend::cpu::CpuBackend;
use dsv4_backend::{Model, Snapshot};
use dsv4_dspark::{ContextRing, Draft, DsparkError};
use dsv4_engine::disk_cache::{encode, read_file, DiskCache};
use dsv4_engine::speculative::{Proposer, SpecConfig};
use dsv4_engine::{spawn, AdmitError, EngineConfig, EngineHandle, Event, PrefixCacheConfig, Request, SamplingParams};
use dsv4_model::store::write_safetensors;
use dsv4_model::synth::{random_checkpoint, tiny_config, SynthDType};
use rand::RngCore;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn model_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(97);
    cfg.max_position = 4096;
    std::fs::write(d.path().join("config.json"), cfg.to_hf_json().to_string()).unwrap();
    write_safetensors(&d.path().join("model.safetensors"), &random_checkpoint(&cfg, 11, SynthDType::F32)).unwrap();
    d
}

fn request(prompt: &[u32], n: usize) -> Request {
    Request {
        prompt: prompt.to_vec(),
        sampling: SamplingParams::default(),
        max_tokens: n,
        stop_ids: vec![],
        top_logprobs: None,
        snapshot_at: vec![],
        logits: Default::default(),
    }
}

fn run(h: &EngineHandle, prompt: &[u32], n: usize) -> Result<(Vec<u32>, usize), String> {
    let mut sub = h.submit(request(prompt, n)).map_err(|e| e.to_string())?;
    let mut toks = Vec::new();
    loop {
        match sub.events.blocking_recv() {
            Some(Event::Token(t)) => toks.push(t.id),
            Some(Event::Done { cached_tokens, .. }) => return Ok((toks, cached_tokens)),
            Some(Event::Error(e)) => return Err(e),
            None => return Err("stream dropped".into()),
        }
    }
}

fn prompt(n: usize, salt: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7 + salt * 13) % 97) as u32).collect()
}

fn disk_engine(dir: &Path, disk: &Path) -> EngineHandle {
    let m = Model::load(CpuBackend, dir, 2, false).unwrap();
    let prefix_cache = Some(PrefixCacheConfig {
        memory_budget: 64 << 20,
        disk_dir: Some(disk.to_path_buf()),
        disk_budget: 64 << 20,
        fingerprint: 5,
        interval: 0,
    });
    spawn(m, EngineConfig { token_budget: 64, prefill_chunk: 32, prefix_cache, ..Default::default() }, 2)
}

/// Every state a real sequence holds passes the check, at every length (and after rollbacks);
/// so the check refuses only states no sequence can hold.
#[test]
fn genuine_states_pass_the_check() {
    let dir = model_dir();
    let mut m = Model::load(CpuBackend, dir.path(), 1, false).unwrap();
    let s = m.alloc_seq().unwrap();
    let toks = prompt(90, 1);
    for (i, &t) in toks.iter().enumerate() {
        m.prefill_chunks(s, &[t], &[1]).unwrap();
        let snap = m.snapshot(s).unwrap();
        assert_eq!(snap.len, i + 1);
        snap.state.check(&m.cfg, snap.len).unwrap_or_else(|e| panic!("length {}: {e}", i + 1));
        if i % 9 == 8 {
            m.truncate(s, i - 3).unwrap();
            let cut = m.snapshot(s).unwrap();
            cut.state.check(&m.cfg, cut.len).unwrap_or_else(|e| panic!("cut to {}: {e}", cut.len));
            m.prefill_chunks(s, &toks[i - 3..=i], &[4]).unwrap();
        }
    }
}

/// Snapshot files whose checksum is right but whose state does not fit their tokens (the
/// "window ring lost position" panic of the issue) are refused, deleted, and the engine serves
/// the prompt cold with the cold tokens.
#[test]
fn forged_snapshots_are_refused_and_deleted() {
    let dir = model_dir();
    let mut m = Model::load(CpuBackend, dir.path(), 1, false).unwrap();
    let cfg = m.cfg.clone();
    let p = prompt(40, 2);
    let s = m.alloc_seq().unwrap();
    m.prefill_chunks(s, &p[..30], &[30]).unwrap();
    let snap = m.snapshot(s).unwrap();
    let longer = p[..36].to_vec();
    let ring_moved = {
        let mut st = snap.state.clone();
        let l = &mut st.layers[0];
        let cap = l.ring_pos.len();
        l.ring_pos[29 % cap] = 1000;
        Snapshot { len: 30, state: st }
    };
    let entries_dropped = {
        let mut st = snap.state.clone();
        let c = st.layers.iter_mut().find_map(|l| l.comp.as_mut()).expect("a compressed layer");
        let keep = c.entries.len() - c.head;
        c.entries.truncate(keep);
        Snapshot { len: 30, state: st }
    };
    let nan = {
        let mut st = snap.state.clone();
        st.layers[1].ring[3] = f32::NAN;
        Snapshot { len: 30, state: st }
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        // The state of 30 tokens filed under 36 (and under a shorter prefix).
        ("claims-more-tokens", encode(&longer, &snap, 5)),
        ("claims-fewer-tokens", encode(&p[..20], &snap, 5)),
        ("ring-position", encode(&p[..30], &ring_moved, 5)),
        ("entries", encode(&p[..30], &entries_dropped, 5)),
        ("nan", encode(&p[..30], &nan, 5)),
    ];
    let cold = {
        let d = tempfile::tempdir().unwrap();
        run(&disk_engine(dir.path(), d.path()), &p, 6).unwrap().0
    };
    for (name, bytes) in cases {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join(format!("{name}.dsv4kv"));
        std::fs::write(&f, &bytes).unwrap();
        assert!(read_file(&f, 5, &cfg).is_err(), "{name} was accepted");
        let e = disk_engine(dir.path(), d.path());
        let (got, cached) = run(&e, &p, 6).unwrap_or_else(|err| panic!("{name}: {err}"));
        assert_eq!((got, cached), (cold.clone(), 0), "{name}");
        assert!(e.is_alive());
        assert!(!f.exists(), "{name}: refused file not deleted");
    }
    // The genuine snapshot is used and gives the same tokens.
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("good.dsv4kv"), encode(&p[..30], &snap, 5)).unwrap();
    let (got, cached) = run(&disk_engine(dir.path(), d.path()), &p, 6).unwrap();
    assert_eq!((got, cached), (cold, 30));
}

/// A FIFO named like a snapshot would block `open` forever: startup skips it (and other
/// non-regular files) and finishes; corrupt files are deleted, unrelated files are left alone.
#[cfg(unix)]
#[test]
fn fifo_in_the_cache_dir_does_not_hang_and_rejects_are_deleted() {
    let dir = model_dir();
    let cfg = Model::load(CpuBackend, dir.path(), 1, false).unwrap().cfg;
    let d = tempfile::tempdir().unwrap();
    let fifo = d.path().join("fifo.dsv4kv");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    std::os::unix::fs::symlink("/dev/zero", d.path().join("zero.dsv4kv")).unwrap();
    std::fs::write(d.path().join("junk.dsv4kv"), b"not a snapshot at all, not at all").unwrap();
    std::fs::write(d.path().join("notes.txt"), b"mine").unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let (path, c) = (d.path().to_path_buf(), cfg.clone());
    std::thread::spawn(move || {
        let dc = DiskCache::open(&path, 1 << 30, 5, &c).map(|dc| (dc.files(), dc.rejected));
        let _ = tx.send(dc.map_err(|e| e.to_string()));
    });
    let (files, rejected) = rx.recv_timeout(Duration::from_secs(20)).expect("opening the cache hung").unwrap();
    assert_eq!((files, rejected), (0, 3));
    assert!(!d.path().join("junk.dsv4kv").exists(), "corrupt file kept");
    assert!(d.path().join("notes.txt").exists(), "unrelated file deleted");
    assert!(fifo.exists(), "a FIFO is skipped, not removed");
}

/// Panics inside a step (here: in the drafter) fail that step's requests with an error; the
/// engine stays alive, frees the slots and serves the next requests exactly.
#[test]
fn a_panicking_step_fails_its_requests_and_the_engine_goes_on() {
    struct Bomb {
        left: AtomicUsize,
        layers: Vec<usize>,
        width: usize,
    }
    impl Proposer for Bomb {
        fn layers(&self) -> &[usize] {
            &self.layers
        }
        fn block_size(&self) -> usize {
            2
        }
        fn new_ring(&self) -> ContextRing {
            ContextRing::new(1, 4096, self.width)
        }
        fn commit(&self, ring: &mut ContextRing, rows: &[(usize, &[f32])]) -> Result<(), DsparkError> {
            for (p, h) in rows {
                ring.write(*p, &[h]);
            }
            Ok(())
        }
        fn draft(
            &self,
            _r: &ContextRing,
            _a: u32,
            _p: usize,
            _t: f32,
            _g: &mut dyn RngCore,
        ) -> Result<Draft, DsparkError> {
            if self.left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
                panic!("window ring lost position 7 (planted)");
            }
            Err(DsparkError::NotDspark("no draft in this test".into()))
        }
    }
    let dir = model_dir();
    let plain = spawn(Model::load(CpuBackend, dir.path(), 2, false).unwrap(), EngineConfig::default(), 2);
    let want = run(&plain, &prompt(12, 3), 5).unwrap().0;
    let sc =
        SpecConfig::new(Arc::new(Bomb { left: AtomicUsize::new(2), layers: vec![0], width: tiny_config(97).hidden }));
    let cfg = EngineConfig { dspark: Some(sc), ..Default::default() };
    let e = spawn(Model::load(CpuBackend, dir.path(), 2, false).unwrap(), cfg, 2);
    // Two panics: each fails the requests of its step with a clear error.
    for _ in 0..2 {
        let err = run(&e, &prompt(12, 3), 5).unwrap_err();
        assert!(err.contains("internal error"), "{err}");
        assert!(e.is_alive());
    }
    // Then the engine serves again, with every slot free and the same tokens as a plain run.
    let (a, b) = (prompt(12, 3), prompt(12, 3));
    let h2 = e.clone();
    let t = std::thread::spawn(move || run(&h2, &b, 5));
    assert_eq!(run(&e, &a, 5).unwrap().0, want);
    assert_eq!(t.join().unwrap().unwrap().0, want);
}

/// The waiting limit counts queued requests exactly, even while the engine is busy in a step
/// and has not yet seen them: a burst of submits never gets more than `max_waiting` queued.
#[test]
fn the_waiting_limit_holds_under_a_burst() {
    let dir = model_dir();
    let m = Model::load(CpuBackend, dir.path(), 1, false).unwrap();
    let e = spawn(m, EngineConfig { max_waiting: 3, token_budget: 8, prefill_chunk: 8, ..Default::default() }, 1);
    // One long request holds the only slot.
    let long = e.submit(request(&prompt(200, 4), 2000)).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let mut subs = Vec::new();
    let mut full = 0;
    for i in 0..40 {
        match e.submit(request(&prompt(5, i), 1)) {
            Ok(s) => subs.push(s),
            Err(AdmitError::QueueFull { .. }) => full += 1,
            Err(other) => panic!("{other}"),
        }
    }
    assert_eq!((subs.len(), full), (3, 37));
    // Leaving the queue frees the places.
    drop(subs);
    long.cancel.cancel();
    drop(long);
    let mut ok = false;
    for _ in 0..200 {
        if let Ok(r) = run(&e, &prompt(5, 99), 1) {
            ok = r.0.len() == 1;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(ok, "the queue never drained");
}

/// Weights changed in the middle of a file (size kept) change the fingerprint, so stale
/// snapshots are never served; an unchanged file's hash comes from the cache, keyed by path,
/// size and modification time.
#[test]
fn the_fingerprint_covers_every_weight_byte_and_caches_per_file() {
    use dsv4_engine::fingerprint::model_fingerprint;
    let d = tempfile::tempdir().unwrap();
    let cache = d.path().join("kv").join(".weight-hashes");
    let w = d.path().join("model.safetensors");
    std::fs::write(d.path().join("config.json"), b"{\"a\": 1}").unwrap();
    let mut bytes: Vec<u8> = (0..5u32 << 20).map(|i| (i.wrapping_mul(2654435761) >> 11) as u8).collect();
    std::fs::write(&w, &bytes).unwrap();
    let mtime = std::fs::metadata(&w).unwrap().modified().unwrap();
    let a = model_fingerprint(d.path(), Some(&cache));
    assert!(cache.exists());
    assert_eq!(model_fingerprint(d.path(), Some(&cache)), a);
    // One byte 2.5 MiB in (outside the first and last MiB), same size, new mtime.
    bytes[5 << 19] ^= 0x40;
    std::fs::write(&w, &bytes).unwrap();
    let f = std::fs::File::options().write(true).open(&w).unwrap();
    f.set_modified(mtime + Duration::from_secs(5)).unwrap();
    drop(f);
    let b = model_fingerprint(d.path(), Some(&cache));
    assert_ne!(a, b, "a weight change in the middle went unseen");
    assert_ne!(model_fingerprint(d.path(), None), a);
    // Same size and mtime as the cached entry: the cached hash is used (the file is not reread).
    bytes[5 << 19] ^= 0x40;
    bytes[7] ^= 1;
    std::fs::write(&w, &bytes).unwrap();
    let f = std::fs::File::options().write(true).open(&w).unwrap();
    f.set_modified(mtime + Duration::from_secs(5)).unwrap();
    drop(f);
    assert_eq!(model_fingerprint(d.path(), Some(&cache)), b);
    assert_ne!(model_fingerprint(d.path(), None), b);
    // config.json counts too.
    std::fs::write(d.path().join("config.json"), b"{\"a\": 2}").unwrap();
    assert_ne!(model_fingerprint(d.path(), Some(&cache)), b);
}
