//! Small parsing and file helpers of the command line.

use anyhow::{bail, Context, Result};
use std::io::Write;
use std::path::Path;

/// Parses `5,17,3` (spaces allowed).
pub fn parse_list(s: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| x.parse::<usize>().with_context(|| format!("`{x}` is not a non-negative integer")))
        .collect()
}

/// `5,17,3`, or `@file.json` holding a JSON list of ids.
pub fn parse_tokens(s: &str) -> Result<Vec<u32>> {
    let v: Vec<usize> = if let Some(path) = s.strip_prefix('@') {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
        serde_json::from_str(&text).with_context(|| format!("{path}: expected a JSON list of token ids"))?
    } else {
        parse_list(s).context("--tokens")?
    };
    v.into_iter().map(|x| u32::try_from(x).map_err(|_| anyhow::anyhow!("token id {x} is too large"))).collect()
}

/// Writes a float32 .npy file of shape `[rows, cols]` (format version 1.0).
pub fn write_npy(path: &Path, data: &[f32], rows: usize, cols: usize) -> Result<()> {
    if data.len() != rows * cols {
        bail!("npy: {} values for shape [{rows}, {cols}]", data.len());
    }
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    // magic (6) + version (2) + length (2) + header + '\n' padded to a multiple of 64.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut f =
        std::io::BufWriter::new(std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?);
    f.write_all(b"\x93NUMPY\x01\x00")?;
    f.write_all(&(header.len() as u16).to_le_bytes())?;
    f.write_all(header.as_bytes())?;
    for v in data {
        f.write_all(&v.to_le_bytes())?;
    }
    f.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_and_tokens_parse() {
        assert_eq!(parse_list("13, 1,1").unwrap(), vec![13, 1, 1]);
        assert!(parse_list("1,x").is_err());
        assert_eq!(parse_tokens("5,17,3").unwrap(), vec![5, 17, 3]);
        assert!(parse_tokens("99999999999").is_err());
    }

    #[test]
    fn npy_header_is_aligned() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.npy");
        write_npy(&p, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2, 3).unwrap();
        let b = std::fs::read(&p).unwrap();
        assert_eq!(&b[..6], b"\x93NUMPY");
        let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
        assert_eq!((10 + hl) % 64, 0);
        assert_eq!(b.len(), 10 + hl + 24);
        assert!(std::str::from_utf8(&b[10..10 + hl]).unwrap().contains("'shape': (2, 3)"));
    }
}
