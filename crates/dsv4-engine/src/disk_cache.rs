//! Snapshots on disk, found again by later requests and after a restart.
//!
//! One file per snapshot, named from a hash of its tokens (no request data reaches a path, so
//! nothing escapes the directory). Format v1, little-endian:
//! `b"DSV4KVC\0"`, version u32, model fingerprint u64, token count u64, tokens (u32 each),
//! state length u64, state bytes ([`SeqState::to_bytes`]), FNV-1a 64 checksum of all before.
//! Files are written to a temporary name, fsynced and renamed, so a killed writer leaves only a
//! temporary file, which is never read (and is removed at the next start). A file that is
//! truncated, corrupted, of another model or of another version, or whose state does not fit the
//! model and its tokens, is refused with a warning, never produces a token and is deleted (it
//! would otherwise sit outside the disk budget forever). Anything in the directory that is not a
//! regular file (a FIFO, a device, a symlink) is skipped without being opened.

use crate::prefix_cache::prefix_hashes;
use dsv4_backend::{SeqState, Snapshot};
use dsv4_model::Config;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

pub const MAGIC: &[u8; 8] = b"DSV4KVC\0";
pub const VERSION: u32 = 1;
const EXT: &str = "dsv4kv";

pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

struct DiskEntry {
    tokens: Vec<u32>,
    hash: u64,
    path: PathBuf,
    bytes: u64,
    stamp: u64,
}

pub struct DiskCache {
    dir: PathBuf,
    budget: usize,
    fingerprint: u64,
    model: Config,
    index: Vec<DiskEntry>,
    stamp: u64,
    /// Files refused (bad checksum, other model, other version, truncated).
    pub rejected: u64,
    pub writes: u64,
}

/// Why a file was not used.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("not a dsv4 KV snapshot")]
    Magic,
    #[error("format version {0}, this build reads {VERSION}")]
    Version(u32),
    #[error("snapshot of another model")]
    OtherModel,
    #[error("truncated or corrupted snapshot: {0}")]
    Corrupt(String),
    #[error("not a regular file")]
    NotAFile,
}

/// Opening a FIFO for reading blocks until a writer comes: only regular files are opened.
fn check_regular(path: &Path) -> Result<(), DiskError> {
    let md = std::fs::symlink_metadata(path)?;
    if !md.file_type().is_file() {
        return Err(DiskError::NotAFile);
    }
    Ok(())
}

/// Deletes a refused snapshot file (never anything but a regular file).
fn discard(path: &Path, why: &DiskError) {
    tracing::warn!("deleting refused KV snapshot {}: {why}", path.display());
    if check_regular(path).is_ok() {
        if let Err(e) = std::fs::remove_file(path) {
            tracing::warn!("could not delete {}: {e}", path.display());
        }
    }
}

fn read_header(path: &Path, fingerprint: u64) -> Result<Vec<u32>, DiskError> {
    check_regular(path)?;
    let mut f = std::fs::File::open(path)?;
    let mut head = [0u8; 28];
    f.read_exact(&mut head).map_err(|_| DiskError::Corrupt("short header".into()))?;
    if &head[..8] != MAGIC {
        return Err(DiskError::Magic);
    }
    let version = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
    if version != VERSION {
        return Err(DiskError::Version(version));
    }
    if u64::from_le_bytes(head[12..20].try_into().expect("8 bytes")) != fingerprint {
        return Err(DiskError::OtherModel);
    }
    let n = u64::from_le_bytes(head[20..28].try_into().expect("8 bytes")) as usize;
    let file_len = f.metadata()?.len() as usize;
    if n.saturating_mul(4) > file_len {
        return Err(DiskError::Corrupt("token count beyond the file".into()));
    }
    let mut buf = vec![0u8; n * 4];
    f.read_exact(&mut buf).map_err(|_| DiskError::Corrupt("short token list".into()))?;
    Ok(buf.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect())
}

/// Reads and fully checks one file.
pub fn read_file(path: &Path, fingerprint: u64, model: &Config) -> Result<(Vec<u32>, Snapshot), DiskError> {
    check_regular(path)?;
    let bytes = std::fs::read(path)?;
    if bytes.len() < 28 + 16 + 8 {
        return Err(DiskError::Corrupt("file too short".into()));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 8);
    if fnv1a(body) != u64::from_le_bytes(sum.try_into().expect("8 bytes")) {
        // Distinguish a foreign or old file from plain corruption for the warning.
        read_header(path, fingerprint)?;
        return Err(DiskError::Corrupt("checksum mismatch".into()));
    }
    let tokens = read_header(path, fingerprint)?;
    let mut off = 28 + tokens.len() * 4;
    let rd = |off: &mut usize| -> Result<u64, DiskError> {
        let v = body.get(*off..*off + 8).ok_or_else(|| DiskError::Corrupt("short".into()))?;
        *off += 8;
        Ok(u64::from_le_bytes(v.try_into().expect("8 bytes")))
    };
    let state_len = rd(&mut off)? as usize;
    let state = body.get(off..off + state_len).ok_or_else(|| DiskError::Corrupt("short state".into()))?;
    if off + state_len != body.len() {
        return Err(DiskError::Corrupt("trailing bytes".into()));
    }
    let state = SeqState::from_bytes(model, state).map_err(|e| DiskError::Corrupt(e.to_string()))?;
    let len = tokens.len();
    // A checksum only says the bytes are those written: the state must also fit the tokens.
    state.check(model, len).map_err(|e| DiskError::Corrupt(e.to_string()))?;
    Ok((tokens, Snapshot { len, state }))
}

/// Encodes one snapshot file.
pub fn encode(tokens: &[u32], snap: &Snapshot, fingerprint: u64) -> Vec<u8> {
    let state = snap.state.to_bytes();
    let mut out = Vec::with_capacity(44 + tokens.len() * 4 + state.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&fingerprint.to_le_bytes());
    out.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
    out.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    out.extend_from_slice(&(state.len() as u64).to_le_bytes());
    out.extend_from_slice(&state);
    let sum = fnv1a(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

impl DiskCache {
    pub fn open(dir: &Path, budget: usize, fingerprint: u64, model: &Config) -> Result<Self, DiskError> {
        std::fs::create_dir_all(dir)?;
        let mut dc = DiskCache {
            dir: dir.to_path_buf(),
            budget,
            fingerprint,
            model: model.clone(),
            index: Vec::new(),
            stamp: 0,
            rejected: 0,
            writes: 0,
        };
        let mut files: Vec<(std::time::SystemTime, PathBuf, u64)> = Vec::new();
        for e in std::fs::read_dir(dir)?.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(".tmp-") {
                // Left by a writer that was killed: never valid, remove it.
                let _ = std::fs::remove_file(&p);
                continue;
            }
            if p.extension().is_some_and(|x| x == EXT) {
                // `DirEntry::metadata` does not follow symlinks: a FIFO or link is never opened.
                let md = e.metadata()?;
                if !md.file_type().is_file() {
                    dc.rejected += 1;
                    tracing::warn!("ignoring {}: not a regular file", p.display());
                    continue;
                }
                files.push((md.modified().unwrap_or(std::time::UNIX_EPOCH), p, md.len()));
            }
        }
        files.sort();
        for (_, path, bytes) in files {
            match read_header(&path, fingerprint) {
                Ok(tokens) => {
                    dc.stamp += 1;
                    let hash = *prefix_hashes(&tokens).last().expect("non-empty");
                    dc.index.push(DiskEntry { tokens, hash, path, bytes, stamp: dc.stamp });
                }
                Err(e @ (DiskError::Io(_) | DiskError::NotAFile)) => {
                    dc.rejected += 1;
                    tracing::warn!("ignoring KV snapshot {}: {e}", path.display());
                }
                Err(e) => {
                    dc.rejected += 1;
                    discard(&path, &e);
                }
            }
        }
        tracing::info!("disk KV cache {}: {} snapshots", dir.display(), dc.index.len());
        Ok(dc)
    }

    pub fn bytes(&self) -> u64 {
        self.index.iter().map(|e| e.bytes).sum()
    }

    pub fn files(&self) -> usize {
        self.index.len()
    }

    /// The longest valid snapshot on disk longer than `min_len` tokens whose tokens are a
    /// proper prefix of `prompt` (`h` = its prefix hashes).
    pub fn lookup(&mut self, prompt: &[u32], h: &[u64], min_len: usize) -> Option<(Vec<u32>, Snapshot)> {
        let mut cands: Vec<usize> = (0..self.index.len())
            .filter(|&i| {
                let e = &self.index[i];
                let n = e.tokens.len();
                n > min_len && n < prompt.len() && h[n] == e.hash && e.tokens[..] == prompt[..n]
            })
            .collect();
        cands.sort_by_key(|&i| std::cmp::Reverse(self.index[i].tokens.len()));
        for i in cands {
            let path = self.index[i].path.clone();
            match read_file(&path, self.fingerprint, &self.model) {
                Ok(hit) => {
                    self.stamp += 1;
                    self.index[i].stamp = self.stamp;
                    return Some(hit);
                }
                Err(e) => {
                    self.rejected += 1;
                    if matches!(e, DiskError::Io(_) | DiskError::NotAFile) {
                        tracing::warn!("ignoring KV snapshot {}: {e}", path.display());
                    } else {
                        discard(&path, &e);
                    }
                    self.index[i].tokens.clear(); // never matches again
                }
            }
        }
        self.index.retain(|e| !e.tokens.is_empty());
        None
    }

    /// Writes a snapshot atomically (temporary file, fsync, rename), then trims to the budget.
    pub fn write(&mut self, tokens: &[u32], snap: &Snapshot) -> Result<(), DiskError> {
        let hash = *prefix_hashes(tokens).last().expect("non-empty");
        if self.index.iter().any(|e| e.hash == hash && e.tokens == tokens) {
            return Ok(());
        }
        let bytes = encode(tokens, snap, self.fingerprint);
        let name = format!("{hash:016x}-{}.{EXT}", tokens.len());
        let tmp = self.dir.join(format!(".tmp-{}-{}", std::process::id(), self.writes));
        let path = self.dir.join(name);
        {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &path)?;
        if let Ok(d) = std::fs::File::open(&self.dir) {
            let _ = d.sync_all();
        }
        self.writes += 1;
        self.stamp += 1;
        self.index.push(DiskEntry {
            tokens: tokens.to_vec(),
            hash,
            path,
            bytes: bytes.len() as u64,
            stamp: self.stamp,
        });
        while self.bytes() as usize > self.budget && self.index.len() > 1 {
            let old = (0..self.index.len()).min_by_key(|&i| self.index[i].stamp).expect("not empty");
            let e = self.index.swap_remove(old);
            let _ = std::fs::remove_file(&e.path);
        }
        Ok(())
    }
}
