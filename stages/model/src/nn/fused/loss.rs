//! The cross-entropy over the vocabulary, per row, and its gradient.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Shape, Tensor, WithDType, bail};
use rayon::prelude::*;

use super::{CpuArg, Result, cpu, rows};

/// Per row of `logits` `[m, vocab]`: `logsumexp(row) - row[label]`, `[m]` in f32 (f64 for f64
/// logits). Differentiable in `logits`.
pub fn cross_entropy(logits: &Tensor, labels: &[u32]) -> Result<Tensor> {
    let (m, vocab) = logits.dims2()?;
    if labels.len() != m {
        bail!("cross_entropy: {m} rows of logits, {} labels", labels.len());
    }
    if let Some(bad) = labels.iter().find(|&&y| y as usize >= vocab) {
        bail!("cross_entropy: label {bad} is past the vocabulary of {vocab}");
    }
    let labels = Tensor::new(labels, logits.device())?;
    logits.contiguous()?.apply_op2(&labels, CrossEntropy {})
}

/// The dtype cross-entropy losses come out in.
pub(super) fn loss_dtype(logits: DType) -> DType {
    if logits == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The log-sum-exp of a row, in f64.
fn lse<T: WithDType>(z: &[T]) -> f64 {
    let max = z
        .iter()
        .map(|v| v.to_f64())
        .fold(f64::NEG_INFINITY, f64::max);
    max + z.iter().map(|v| (v.to_f64() - max).exp()).sum::<f64>().ln()
}

fused_op! {
    /// Per row of `logits` `[m, vocab]`: `logsumexp(row) - row[label]`.
    CrossEntropy {} = "cross-entropy", inputs(logits, labels);
    cpu(_op) => Ok((cross_entropy_cpu(logits, labels)?, Shape::from(rows(logits.1).0)));
    cuda(_op) => Ok((
        super::cuda::cross_entropy(logits, labels)?,
        Shape::from(rows(logits.1).0),
    ));
    bwd(_op, _nll, grad) => {
        let grad = grad.to_dtype(loss_dtype(logits.dtype()))?.contiguous()?;
        let g = logits.apply_op3_no_bwd(labels, &grad, &CrossEntropyGrad {})?;
        Ok((Some(g), None))
    };
}

fused_op! {
    /// The cross-entropy's gradient in the logits, each row scaled by its loss's gradient.
    CrossEntropyGrad {} = "cross-entropy-grad", inputs(logits, labels, grad);
    cpu(_op) => Ok((cross_entropy_grad_cpu(logits, labels, grad)?, logits.1.shape().clone()));
    cuda(_op) => Ok((
        super::cuda::cross_entropy_grad(logits, labels, grad)?,
        logits.1.shape().clone(),
    ));
}

fn cross_entropy_cpu((s1, l1): CpuArg<'_>, (s2, l2): CpuArg<'_>) -> Result<CpuStorage> {
    let (_, n) = rows(l1);
    fn go<T: WithDType>(
        s1: &CpuStorage,
        l1: &Layout,
        labels: &[u32],
        n: usize,
    ) -> Result<Vec<f64>> {
        let z = cpu::<T>(s1, l1)?;
        Ok(z.par_chunks(n)
            .zip(labels.par_iter())
            .map(|(z, &y)| lse(z) - z[y as usize].to_f64())
            .collect())
    }
    let labels = cpu::<u32>(s2, l2)?;
    let nll = by_float!(s1.dtype(), "cross-entropy", go(s1, l1, labels, n))?;
    Ok(match loss_dtype(s1.dtype()) {
        DType::F64 => CpuStorage::F64(nll),
        _ => CpuStorage::F32(nll.into_iter().map(|v| v as f32).collect()),
    })
}

fn cross_entropy_grad_cpu(
    (s1, l1): CpuArg<'_>,
    (s2, l2): CpuArg<'_>,
    (s3, l3): CpuArg<'_>,
) -> Result<CpuStorage> {
    let (_, n) = rows(l1);
    fn go<T: WithDType>(
        s1: &CpuStorage,
        l1: &Layout,
        labels: &[u32],
        g: &[f64],
        n: usize,
    ) -> Result<CpuStorage> {
        let z = cpu::<T>(s1, l1)?;
        let mut out = vec![T::from_f64(0.0); z.len()];
        out.par_chunks_mut(n)
            .zip(z.par_chunks(n))
            .zip(labels.par_iter().zip(g.par_iter()))
            .for_each(|((dz, z), (&y, &g))| {
                let lse = lse(z);
                for (j, (dz, z)) in dz.iter_mut().zip(z).enumerate() {
                    let onehot = if j == y as usize { 1.0 } else { 0.0 };
                    *dz = T::from_f64(g * ((z.to_f64() - lse).exp() - onehot));
                }
            });
        Ok(T::to_cpu_storage_owned(out))
    }
    let labels = cpu::<u32>(s2, l2)?;
    let g: Vec<f64> = match s3 {
        CpuStorage::F64(_) => cpu::<f64>(s3, l3)?.to_vec(),
        _ => cpu::<f32>(s3, l3)?.iter().map(|&v| f64::from(v)).collect(),
    };
    by_float!(s1.dtype(), "cross-entropy-grad", go(s1, l1, labels, &g, n))
}
