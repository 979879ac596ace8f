//! The model fingerprint that disk snapshots are filed under: config.json and every byte of
//! every weight file. Hashing a large checkpoint takes a while, so each file's hash is kept in a
//! small cache file keyed by path, size and modification time; an unchanged file is not reread.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;

/// A streaming 64-bit hash over four independent lanes (fast enough to be bound by the disk).
/// Not cryptographic: it detects changed weights, not an attacker who can write the cache dir.
struct Hasher {
    lanes: [u64; 4],
    tail: Vec<u8>,
    len: u64,
}

impl Hasher {
    fn new() -> Self {
        Hasher { lanes: [P1, P2, P1 ^ P2, !P1], tail: Vec::new(), len: 0 }
    }

    fn stripe(lanes: &mut [u64; 4], s: &[u8]) {
        for (k, lane) in lanes.iter_mut().enumerate() {
            let w = u64::from_le_bytes(s[k * 8..k * 8 + 8].try_into().expect("8 bytes"));
            *lane = lane.wrapping_add(w.wrapping_mul(P2)).rotate_left(31).wrapping_mul(P1);
        }
    }

    fn update(&mut self, mut data: &[u8]) {
        self.len += data.len() as u64;
        if !self.tail.is_empty() {
            let take = (32 - self.tail.len()).min(data.len());
            self.tail.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.tail.len() == 32 {
                let t = std::mem::take(&mut self.tail);
                Self::stripe(&mut self.lanes, &t);
            }
        }
        let mut chunks = data.chunks_exact(32);
        for c in &mut chunks {
            Self::stripe(&mut self.lanes, c);
        }
        self.tail.extend_from_slice(chunks.remainder());
    }

    fn finish(self) -> u64 {
        let mut h = self.len.wrapping_mul(P1);
        for (i, l) in self.lanes.iter().enumerate() {
            h = (h ^ l.rotate_left(i as u32 * 7 + 1)).wrapping_mul(P2).rotate_left(27);
        }
        for &b in &self.tail {
            h = (h ^ b as u64).wrapping_mul(P1).rotate_left(11);
        }
        h ^= h >> 33;
        h = h.wrapping_mul(P2);
        h ^ (h >> 29)
    }
}

/// The hash of a whole file.
pub fn hash_file(path: &Path) -> std::io::Result<u64> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Hasher::new();
    let mut buf = vec![0u8; 8 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(h.finish());
        }
        h.update(&buf[..n]);
    }
}

/// (size, modification time in ns) of a file: a changed file changes one of them.
fn stamp(path: &Path) -> Option<(u64, u128)> {
    let md = std::fs::metadata(path).ok()?;
    let mtime = md.modified().ok()?.duration_since(UNIX_EPOCH).ok()?.as_nanos();
    Some((md.len(), mtime))
}

/// Weight files of a checkpoint: `dir` itself when it is a file, else its safetensors/GGUF files.
fn weight_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = if dir.is_file() {
        vec![dir.to_path_buf()]
    } else {
        std::fs::read_dir(dir)
            .map(|r| {
                r.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "safetensors" || x == "gguf"))
                    .collect()
            })
            .unwrap_or_default()
    };
    files.sort();
    files
}

fn read_cache(path: &Path) -> HashMap<(String, u64, u128), u64> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let mut it = l.splitn(4, '\t');
            let hash = u64::from_str_radix(it.next()?, 16).ok()?;
            let size = it.next()?.parse().ok()?;
            let mtime = it.next()?.parse().ok()?;
            Some(((it.next()?.to_string(), size, mtime), hash))
        })
        .collect()
}

fn write_cache(path: &Path, entries: &HashMap<(String, u64, u128), u64>) {
    let mut text = String::new();
    for ((p, size, mtime), hash) in entries {
        text.push_str(&format!("{hash:016x}\t{size}\t{mtime}\t{p}\n"));
    }
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let ok = path.parent().is_none_or(|d| std::fs::create_dir_all(d).is_ok())
        && std::fs::write(&tmp, text).is_ok()
        && std::fs::rename(&tmp, path).is_ok();
    if !ok {
        let _ = std::fs::remove_file(&tmp);
        tracing::warn!("could not write the weight-hash cache {}", path.display());
    }
}

/// Identifies the checkpoint in `dir` (a directory, or a GGUF file): config.json and the full
/// contents of each weight file, by name. `cache` keeps per-file hashes between runs.
pub fn model_fingerprint(dir: &Path, cache: Option<&Path>) -> u64 {
    let mut known = cache.map(read_cache).unwrap_or_default();
    let mut changed = false;
    let mut h = Hasher::new();
    let config = if dir.is_file() { None } else { std::fs::read(dir.join("config.json")).ok() };
    h.update(config.as_deref().unwrap_or_default());
    for p in weight_files(dir) {
        let abs = std::fs::canonicalize(&p).unwrap_or_else(|_| p.clone());
        let key = stamp(&p).map(|(size, mtime)| (abs.to_string_lossy().into_owned(), size, mtime));
        let file_hash = match key.as_ref().and_then(|k| known.get(k)) {
            Some(&v) => v,
            None => {
                let t = std::time::Instant::now();
                let v = hash_file(&p).unwrap_or(0);
                tracing::info!("hashed {} for the KV cache fingerprint in {:.1?}", p.display(), t.elapsed());
                if let Some(k) = key {
                    known.insert(k, v);
                    changed = true;
                }
                v
            }
        };
        h.update(p.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default());
        h.update(&file_hash.to_le_bytes());
    }
    if let (Some(c), true) = (cache, changed) {
        // Only entries of files that still exist with that stamp are worth keeping.
        known.retain(|(p, size, mtime), _| stamp(Path::new(p)) == Some((*size, *mtime)));
        write_cache(c, &known);
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_equals_one_shot_and_every_byte_counts() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        let one = {
            let mut h = Hasher::new();
            h.update(&data);
            h.finish()
        };
        for split in [1, 7, 31, 32, 33, 999] {
            let mut h = Hasher::new();
            for c in data.chunks(split) {
                h.update(c);
            }
            assert_eq!(h.finish(), one, "split {split}");
        }
        for i in [0, 31, 5000, 9999] {
            let mut d = data.clone();
            d[i] ^= 1;
            let mut h = Hasher::new();
            h.update(&d);
            assert_ne!(h.finish(), one, "byte {i}");
        }
        let mut h = Hasher::new();
        h.update(&data[..9999]);
        assert_ne!(h.finish(), one);
    }
}
