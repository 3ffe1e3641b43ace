//! The `k` largest entries of each row, as indices: DFlash 2's candidates over the vocabulary.
//!
//! Composed from candle ops this was `k` argmax passes, each followed by a scatter that copies
//! the whole `[rows, vocab]` logits to mask the pick: in a training step the largest tensor,
//! copied eight times (on CPU, fusing it cut a DFlash 2 drafter's forward and backward from 4.9 s
//! to 3.8 s at SmolLM2's size). Here it is one pass: each row keeps its best `k` as it reads (on
//! a GPU each thread a strided slice's, then `k` block-wide rounds pick among the threads'
//! best).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Tensor, WithDType, bail};
use rayon::prelude::*;

use super::{CpuArg, Result, cpu, rows};

/// The most candidates the one-pass kernels keep per row (per thread, in registers on a GPU).
pub const MAX_K: usize = 32;

/// Indices `[rows, k]` (u32) of the `k` largest entries of each row of `x` (last dimension),
/// largest first; equal values in index order, as repeated argmaxes give them. No gradient.
pub fn top_k(x: &Tensor, k: usize) -> Result<Tensor> {
    let n = x.dims().last().copied().unwrap_or(0);
    if k == 0 || k > n || k > MAX_K {
        bail!("top-k: k = {k} of rows of {n} (1 to {MAX_K}, at most the row)");
    }
    x.contiguous()?.apply_op1_no_bwd(&TopK { k })
}

fused_op! {
    /// The `k` largest entries' indices per row.
    TopK { k: usize } = "top-k", inputs(x);
    cpu(op) => {
        let (count, _) = rows(x.1);
        Ok((top_k_cpu(x, op.k)?, (count, op.k).into()))
    };
    cuda(op) => {
        let (count, _) = rows(x.1);
        Ok((super::cuda::top_k(x, op.k)?, (count, op.k).into()))
    };
}

/// Whether `(a, i)` ranks before `(b, j)`: larger first, the lower index among equals.
// Exact equality on purpose: equal values are ties, ordered by index as argmax orders them.
#[allow(clippy::float_cmp)]
fn before(a: f64, i: u32, b: f64, j: u32) -> bool {
    a > b || (a == b && i < j)
}

fn top_k_cpu(x: CpuArg<'_>, k: usize) -> Result<CpuStorage> {
    fn go<T: WithDType>((s, l): CpuArg<'_>, k: usize) -> Result<CpuStorage> {
        let x = cpu::<T>(s, l)?;
        let (count, n) = rows(l);
        let mut out = vec![0u32; count * k];
        out.par_chunks_mut(k)
            .zip(x.par_chunks(n))
            .for_each(|(picked, row)| {
                // The best so far, sorted; a value joins only if it ranks before the last (the
                // scan goes up the indices, so an equal value never does: index order holds).
                let mut best: Vec<(f64, u32)> = Vec::with_capacity(k + 1);
                for (j, v) in row.iter().enumerate() {
                    let (v, j) = (v.to_f64(), j as u32);
                    if v.is_nan() {
                        continue;
                    }
                    if best.len() == k && !before(v, j, best[k - 1].0, best[k - 1].1) {
                        continue;
                    }
                    let at = best.partition_point(|&(b, i)| before(b, i, v, j));
                    best.insert(at, (v, j));
                    best.truncate(k);
                }
                for (p, (_, j)) in picked.iter_mut().zip(&best) {
                    *p = *j;
                }
            });
        Ok(CpuStorage::U32(out))
    }
    by_float!(x.0.dtype(), "top-k", go(x, k))
}
