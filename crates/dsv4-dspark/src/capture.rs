//! Taking `main_hidden` from a target forward (spec §3.2).

use dsv4_backend::{Backend, Capture, Stage};

/// Collects the DSpark context rows during a target forward: for every captured layer `L`
/// (ascending), the mean over the `hc_mult` streams of layer `L`'s **output** (the mHC state
/// after its FFN sub-block, stage `layers.L.ffn.residual`), concatenated per row:
/// `main_hidden[t] = concat_L mean_c H_out[L][t, c, :]`, `[rows, len(layers)·hidden]`.
///
/// Use with `Model::forward_with(batch, out_rows, Some(&mut capture))`; rows come in batch
/// order.
pub struct HiddenCapture {
    layers: Vec<usize>,
    hc: usize,
    hidden: usize,
    /// Per captured layer: `[rows, hidden]` means.
    got: Vec<Option<Vec<f32>>>,
}

impl HiddenCapture {
    pub fn new(layers: &[usize], hc_mult: usize, hidden: usize) -> Self {
        HiddenCapture { layers: layers.to_vec(), hc: hc_mult, hidden, got: vec![None; layers.len()] }
    }

    /// The captured rows `[rows, len(layers)·hidden]`; `None` if a layer was not seen (the
    /// forward did not run, or a layer id is out of range).
    pub fn finish(self) -> Option<Vec<f32>> {
        let d = self.hidden;
        let per: Vec<Vec<f32>> = self.got.into_iter().collect::<Option<_>>()?;
        let rows = per[0].len() / d;
        let mut out = Vec::with_capacity(rows * d * per.len());
        for t in 0..rows {
            for p in &per {
                out.extend_from_slice(&p[t * d..(t + 1) * d]);
            }
        }
        Some(out)
    }
}

impl<B: Backend> Capture<B> for HiddenCapture {
    fn capture(&mut self, backend: &B, stage: Stage, t: &B::T) {
        let Some(l) = stage.layer else { return };
        if stage.name != "ffn.residual" {
            return;
        }
        let Some(j) = self.layers.iter().position(|&x| x == l) else { return };
        let (rows, cols) = backend.shape(t);
        let (n, d) = (self.hc, self.hidden);
        assert_eq!(cols, n * d, "mHC state of layer {l} is not [rows, hc·hidden]");
        let x = backend.to_host(t);
        let mut m = vec![0f32; rows * d];
        for (r, mr) in m.chunks_mut(d).enumerate() {
            for c in 0..n {
                let xs = &x[r * cols + c * d..r * cols + (c + 1) * d];
                mr.iter_mut().zip(xs).for_each(|(a, b)| *a += b);
            }
            mr.iter_mut().for_each(|a| *a /= n as f32);
        }
        self.got[j] = Some(m);
    }
}
