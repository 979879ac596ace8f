//! Stage-by-stage comparison of two forwards (`dsv4 debug diff`): two ordered lists of captured
//! stages, one row of numbers per stage, and the first stage beyond tolerance or nonfinite.

use crate::backend::Backend;
use crate::forward::{Capture, Stage};
use std::fmt::Write;

/// One captured intermediate: `[rows, cols]` row-major.
#[derive(Clone, Debug)]
pub struct StageData {
    pub stage: Stage,
    /// Which forward of a chunked run it came from.
    pub chunk: usize,
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

/// A [`Capture`] that copies every stage to the host (a synchronisation per stage on a GPU).
#[derive(Default)]
pub struct Recorder {
    pub chunk: usize,
    pub stages: Vec<StageData>,
}

impl<B: Backend> Capture<B> for Recorder {
    fn capture(&mut self, backend: &B, stage: Stage, t: &B::T) {
        let (rows, cols) = backend.shape(t);
        self.stages.push(StageData { stage, chunk: self.chunk, rows, cols, data: backend.to_host(t) });
    }
}

/// The comparison of one stage.
#[derive(Clone, Debug, PartialEq)]
pub struct StageDiff {
    pub stage: Stage,
    pub chunk: usize,
    pub shape: (usize, usize),
    /// max |a − b|.
    pub max_abs: f64,
    /// max |a − b| / max |b| (`b` is the reference).
    pub max_rel: f64,
    /// The row holding the largest error, or the first nonfinite value.
    pub row: usize,
    /// Either side holds a NaN or ±∞.
    pub nonfinite: bool,
    /// Beyond tolerance or nonfinite.
    pub bad: bool,
}

#[derive(Clone, Debug)]
pub struct DiffReport {
    pub stages: Vec<StageDiff>,
    pub rel_tol: f64,
}

impl DiffReport {
    /// The first stage (forward order) beyond tolerance or nonfinite.
    pub fn first_bad(&self) -> Option<&StageDiff> {
        self.stages.iter().find(|s| s.bad)
    }

    /// The per-stage table and a closing verdict line.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:>5}  {:<40} {:>14}  {:>10}  {:>10}  {:>6}",
            "chunk", "stage", "shape", "max abs", "max rel", "row"
        );
        for d in &self.stages {
            let shape = format!("{}x{}", d.shape.0, d.shape.1);
            let mark = if d.nonfinite {
                "  NONFINITE"
            } else if d.bad {
                "  > tol"
            } else {
                ""
            };
            let _ = writeln!(
                s,
                "{:>5}  {:<40} {:>14}  {:>10.3e}  {:>10.3e}  {:>6}{mark}",
                d.chunk,
                d.stage.to_string(),
                shape,
                d.max_abs,
                d.max_rel,
                d.row
            );
        }
        match self.first_bad() {
            Some(d) => {
                let what = if d.nonfinite { "nonfinite".to_string() } else { format!("rel err {:.3e}", d.max_rel) };
                let _ = writeln!(
                    s,
                    "FIRST DIVERGENCE: chunk {} layer {} stage {} row {}: {what} (tolerance {:.1e})",
                    d.chunk,
                    d.stage.layer.map_or("-".to_string(), |l| l.to_string()),
                    d.stage.name,
                    d.row,
                    self.rel_tol
                );
            }
            None => {
                let worst = self.stages.iter().fold(0f64, |m, d| m.max(d.max_rel));
                let _ = writeln!(
                    s,
                    "all {} stages within rel tolerance {:.1e} (worst {worst:.3e})",
                    self.stages.len(),
                    self.rel_tol
                );
            }
        }
        s
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DiffError {
    #[error("the runs captured {a} and {b} stages")]
    Count { a: usize, b: usize },
    #[error("capture {i}: {a} (chunk {ca}) vs {b} (chunk {cb})")]
    Stage { i: usize, a: String, ca: usize, b: String, cb: usize },
    #[error("{stage}: shape {a:?} vs {b:?}")]
    Shape { stage: String, a: (usize, usize), b: (usize, usize) },
}

/// Compares `a` (the backend under test) with `b` (the reference), stage by stage in order.
pub fn diff_stages(a: &[StageData], b: &[StageData], rel_tol: f64) -> Result<DiffReport, DiffError> {
    if a.len() != b.len() {
        return Err(DiffError::Count { a: a.len(), b: b.len() });
    }
    let mut stages = Vec::with_capacity(a.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if x.stage != y.stage || x.chunk != y.chunk {
            return Err(DiffError::Stage {
                i,
                a: x.stage.to_string(),
                ca: x.chunk,
                b: y.stage.to_string(),
                cb: y.chunk,
            });
        }
        let shape = (x.rows, x.cols);
        if shape != (y.rows, y.cols) || x.data.len() != y.data.len() {
            return Err(DiffError::Shape { stage: x.stage.to_string(), a: shape, b: (y.rows, y.cols) });
        }
        stages.push(diff_one(x, y, rel_tol));
    }
    Ok(DiffReport { stages, rel_tol })
}

fn diff_one(x: &StageData, y: &StageData, rel_tol: f64) -> StageDiff {
    let cols = x.cols.max(1);
    let scale = y.data.iter().filter(|v| v.is_finite()).fold(0f64, |m, v| m.max(v.abs() as f64));
    let mut max_abs = 0f64;
    let mut worst_row = 0;
    let mut first_nonfinite = None;
    for (i, (&p, &q)) in x.data.iter().zip(&y.data).enumerate() {
        if !p.is_finite() || !q.is_finite() {
            first_nonfinite.get_or_insert(i / cols);
            continue;
        }
        let e = (p as f64 - q as f64).abs();
        if e > max_abs {
            max_abs = e;
            worst_row = i / cols;
        }
    }
    let max_rel = if scale > 0.0 {
        max_abs / scale
    } else if max_abs > 0.0 {
        f64::INFINITY
    } else {
        0.0
    };
    let nonfinite = first_nonfinite.is_some();
    StageDiff {
        stage: x.stage,
        chunk: x.chunk,
        shape: (x.rows, x.cols),
        max_abs,
        max_rel,
        row: first_nonfinite.unwrap_or(worst_row),
        nonfinite,
        bad: nonfinite || max_rel > rel_tol,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(seed: u32) -> Vec<StageData> {
        let names =
            [(None, "embed"), (Some(0), "attn.kv"), (Some(0), "ffn.out"), (Some(1), "attn.kv"), (None, "logits")];
        names
            .iter()
            .enumerate()
            .map(|(i, &(layer, name))| StageData {
                stage: Stage { layer, name },
                chunk: 0,
                rows: 3,
                cols: 4,
                data: (0..12).map(|j| ((i * 12 + j) as f32 * 0.37 + seed as f32).sin()).collect(),
            })
            .collect()
    }

    #[test]
    fn equal_runs_pass() {
        let r = diff_stages(&list(1), &list(1), 1e-4).unwrap();
        assert!(r.first_bad().is_none());
        assert!(r.stages.iter().all(|d| d.max_abs == 0.0));
        assert!(r.render().contains("all 5 stages within"));
    }

    #[test]
    fn planted_divergence_is_named() {
        let (mut a, b) = (list(1), list(1));
        a[1].data[5] += 1e-6; // within tolerance
        a[3].data[9] += 0.5; // layer 1 attn.kv, row 2
        a[4].data[0] += 0.5; // later stage also off: not the first
        let r = diff_stages(&a, &b, 1e-4).unwrap();
        let d = r.first_bad().unwrap();
        assert_eq!(d.stage, Stage { layer: Some(1), name: "attn.kv" });
        assert_eq!(d.row, 2);
        assert!(!d.nonfinite);
        assert!((d.max_abs - 0.5).abs() < 1e-6);
        assert!(!r.stages[1].bad && r.stages[1].max_abs > 0.0);
        assert!(r.render().contains("FIRST DIVERGENCE: chunk 0 layer 1 stage attn.kv row 2"));
    }

    #[test]
    fn planted_nan_is_named() {
        let (mut a, b) = (list(1), list(1));
        a[2].data[4] = f32::NAN; // layer 0 ffn.out, row 1
        let r = diff_stages(&a, &b, 1e-4).unwrap();
        let d = r.first_bad().unwrap();
        assert_eq!(d.stage, Stage { layer: Some(0), name: "ffn.out" });
        assert!(d.nonfinite);
        assert_eq!(d.row, 1);
        assert!(r.render().contains("nonfinite"));
        // A NaN on the reference side counts too.
        let (a, mut b) = (list(1), list(1));
        b[0].data[11] = f32::INFINITY;
        let r = diff_stages(&a, &b, 1e-4).unwrap();
        assert_eq!(r.first_bad().unwrap().stage.name, "embed");
    }

    #[test]
    fn mismatched_lists_are_errors() {
        let (a, mut b) = (list(1), list(1));
        assert_eq!(diff_stages(&a, &b[..4], 1e-4).unwrap_err(), DiffError::Count { a: 5, b: 4 });
        b[2].stage.name = "ffn.routed";
        assert!(matches!(diff_stages(&a, &b, 1e-4), Err(DiffError::Stage { i: 2, .. })));
        let mut c = list(1);
        c[0].cols = 6;
        c[0].rows = 2;
        assert!(matches!(diff_stages(&a, &c, 1e-4), Err(DiffError::Shape { .. })));
    }
}
