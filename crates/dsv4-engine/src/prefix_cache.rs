//! Prefix cache: snapshots of whole sequence states keyed by the tokens they hold, in memory
//! under a byte budget (LRU), spilled to a disk directory on eviction and shutdown.
//!
//! A request restores the longest cached snapshot whose tokens are a proper prefix of its prompt
//! and prefills only the rest. Lookup hashes every prefix of the prompt once (O(prompt)) and
//! compares it with each entry's hash, so it costs O(prompt + entries), like a radix walk.

use crate::disk_cache::DiskCache;
use dsv4_backend::Snapshot;
use dsv4_model::Config;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Clone, Debug)]
pub struct PrefixCacheConfig {
    /// Bytes of snapshots kept in memory.
    pub memory_budget: usize,
    /// Directory for snapshots on disk (kept across restarts).
    pub disk_dir: Option<PathBuf>,
    pub disk_budget: usize,
    /// Identifies the model; disk snapshots of another model are ignored.
    pub fingerprint: u64,
    /// Long prefills are also snapshotted every this many tokens (0: never).
    pub interval: usize,
}

/// Rolling hash of token prefixes: `h[i]` covers `tokens[..i]`.
pub fn prefix_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h = Vec::with_capacity(tokens.len() + 1);
    let mut x: u64 = 0xcbf2_9ce4_8422_2325;
    h.push(x);
    for &t in tokens {
        x = (x ^ t as u64).wrapping_mul(0x0000_0100_0000_01B3).rotate_left(5) ^ 0x9E37_79B9;
        h.push(x);
    }
    h
}

struct Entry {
    tokens: Arc<[u32]>,
    hash: u64,
    snap: Arc<Snapshot>,
    bytes: usize,
    last_used: u64,
    on_disk: bool,
}

/// What a lookup found.
pub struct Hit {
    pub len: usize,
    pub snap: Arc<Snapshot>,
}

pub struct PrefixCache {
    entries: Vec<Entry>,
    mem_bytes: usize,
    cfg: PrefixCacheConfig,
    clock: u64,
    pub disk: Option<DiskCache>,
}

impl PrefixCache {
    pub fn new(cfg: PrefixCacheConfig, model: &Config) -> Self {
        let disk =
            cfg.disk_dir.as_ref().and_then(|d| match DiskCache::open(d, cfg.disk_budget, cfg.fingerprint, model) {
                Ok(dc) => Some(dc),
                Err(e) => {
                    tracing::warn!("disk KV cache disabled: {e}");
                    None
                }
            });
        PrefixCache { entries: Vec::new(), mem_bytes: 0, cfg, clock: 0, disk }
    }

    pub fn interval(&self) -> usize {
        self.cfg.interval
    }

    pub fn memory_bytes(&self) -> usize {
        self.mem_bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The longest cached state whose tokens are a proper prefix of `prompt` (at least one
    /// prompt token is left to prefill, so the request still gets next-token logits).
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<Hit> {
        let h = prefix_hashes(prompt);
        self.clock += 1;
        let mut best: Option<usize> = None;
        for (i, e) in self.entries.iter().enumerate() {
            let n = e.tokens.len();
            if n < prompt.len()
                && h[n] == e.hash
                && *e.tokens == prompt[..n]
                && best.is_none_or(|b| n > self.entries[b].tokens.len())
            {
                best = Some(i);
            }
        }
        let mem_len = best.map_or(0, |b| self.entries[b].tokens.len());
        // A longer prefix may be on disk (written by an eviction or an earlier process).
        if let Some(disk) = &mut self.disk {
            if let Some((tokens, snap)) = disk.lookup(prompt, &h, mem_len) {
                let len = tokens.len();
                let snap = Arc::new(snap);
                self.insert_arc(tokens.into(), snap.clone(), true);
                return Some(Hit { len, snap });
            }
        }
        let b = best?;
        self.entries[b].last_used = self.clock;
        Some(Hit { len: mem_len, snap: self.entries[b].snap.clone() })
    }

    /// Caches the state holding exactly `tokens`.
    pub fn insert(&mut self, tokens: &[u32], snap: Snapshot) {
        debug_assert_eq!(tokens.len(), snap.len);
        self.insert_arc(tokens.into(), Arc::new(snap), false);
    }

    fn insert_arc(&mut self, tokens: Arc<[u32]>, snap: Arc<Snapshot>, on_disk: bool) {
        self.clock += 1;
        let hash = *prefix_hashes(&tokens).last().expect("at least the empty prefix");
        if let Some(e) = self.entries.iter_mut().find(|e| e.hash == hash && e.tokens == tokens) {
            e.last_used = self.clock;
            return;
        }
        let bytes = snap.state.size_bytes() + 4 * tokens.len();
        self.mem_bytes += bytes;
        self.entries.push(Entry { tokens, hash, snap, bytes, last_used: self.clock, on_disk });
        while self.mem_bytes > self.cfg.memory_budget && !self.entries.is_empty() {
            let lru = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_used).expect("not empty");
            let e = self.entries.swap_remove(lru);
            self.mem_bytes -= e.bytes;
            self.spill(&e);
        }
    }

    fn spill(&mut self, e: &Entry) {
        if let (Some(disk), false) = (&mut self.disk, e.on_disk) {
            if let Err(err) = disk.write(&e.tokens, &e.snap) {
                tracing::warn!("writing a KV snapshot to disk failed: {err}");
            }
        }
    }

    /// Writes one snapshot to the disk cache now (if there is one), besides caching it.
    pub fn persist(&mut self, tokens: &[u32], snap: &Snapshot) {
        if let Some(disk) = &mut self.disk {
            if let Err(err) = disk.write(tokens, snap) {
                tracing::warn!("writing a KV snapshot to disk failed: {err}");
            }
        }
    }

    /// Writes every in-memory snapshot to disk (shutdown).
    pub fn persist_all(&mut self) {
        let entries = std::mem::take(&mut self.entries);
        for e in &entries {
            self.spill(e);
        }
        self.entries = entries;
        for e in &mut self.entries {
            e.on_disk |= self.disk.is_some();
        }
    }
}
