//! Fused ops with backward passes of their own, for the hot spots of a training step.
//!
//! Composed from candle ops, attention's softmax over `[heads, blocks x B, context + blocks x B]`
//! scores and the cross-entropy over `[rows, vocab]` logits each write and keep several
//! f32 intermediates of that size, and candle's backward adds a zero-filled buffer and an add
//! per intermediate: on an H200 that, not the matmuls, was most of the step. Here each is one
//! kernel forward and one backward that keeps only what the gradient needs (the probabilities;
//! the logits). AdamW's update is two in-place kernels instead of a dozen allocating ones.
//!
//! Every op has a CPU implementation (used by CPU training and by the tests, which check it
//! against the composed ops and finite differences) and, with the `cuda` feature, CUDA kernels
//! (`kernels.cu`) for f32 and bf16; arithmetic is f32 on the GPU and f64 on the CPU.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp2, CustomOp3, DType, InplaceOp2, InplaceOp3, Layout, Shape, Tensor,
    WithDType, bail,
};
use rayon::prelude::*;

use super::Result;
use super::ops::BlockGeometry;

/// `softmax(scores * scale + mask)` over the last dimension. `scores`: `[.., nq, nk]`;
/// `mask`: additive `[nq, nk]` (0 or -inf), the same for every leading index. A row masked
/// everywhere gives zeros. Differentiable in `scores`.
pub fn masked_softmax(scores: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    let dims = scores.dims();
    let (nq, nk) = mask.dims2()?;
    if dims.len() < 2 || dims[dims.len() - 2..] != [nq, nk] {
        bail!("masked_softmax: scores {dims:?} do not end in the mask's [{nq}, {nk}]");
    }
    let mask = mask.to_dtype(scores.dtype())?.contiguous()?;
    scores
        .contiguous()?
        .apply_op2(&mask, MaskedSoftmax { scale })
}

/// `scale * p * (dp - sum(dp * p))` per row: the gradient of the scores of a
/// [`masked_softmax`] given its output `p` and the output's gradient `dp` (not tracked).
pub fn softmax_grad(p: &Tensor, dp: &Tensor, scale: f64) -> Result<Tensor> {
    p.contiguous()?
        .apply_op2_no_bwd(&dp.contiguous()?, &SoftmaxGrad { scale })
}

/// The graph node of a block attention computed untracked
/// ([`super::ops::block_attention`]): its forward hands over `out` (copied: candle's ops own
/// their results), its backward is [`BlockGeometry::backward`] with the kept `probs`. The
/// context's and blocks' keys and values enter as one `[kv, s + m, d]` tensor each.
pub(crate) fn attention_node(
    q: &Tensor,
    (ck, cv): (&Tensor, &Tensor),
    (bk, bv): (&Tensor, &Tensor),
    out: Tensor,
    probs: Tensor,
    geometry: BlockGeometry,
) -> Result<Tensor> {
    let k = Tensor::cat(&[ck, bk], 1)?;
    let v = Tensor::cat(&[cv, bv], 1)?;
    q.apply_op3(
        &k,
        &v,
        AttentionNode {
            out,
            probs,
            geometry,
            context: ck.dim(1)?,
        },
    )
}

struct AttentionNode {
    out: Tensor,
    probs: Tensor,
    geometry: BlockGeometry,
    context: usize,
}

impl CustomOp3 for AttentionNode {
    fn name(&self) -> &'static str {
        "block-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        handed_over(&self.out, on_cpu)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        handed_over(&self.out, on_cuda)
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        d_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let s = self.context;
        let m = k.dim(1)? - s;
        let (q, k, v) = (q.detach(), k.detach(), v.detach());
        let [dq, d_ck, d_cv, d_bk, d_bv] = self.geometry.backward(
            &q,
            (&k.narrow(1, 0, s)?, &v.narrow(1, 0, s)?),
            (&k.narrow(1, s, m)?, &v.narrow(1, s, m)?),
            &self.probs,
            d_out,
        )?;
        Ok((
            Some(dq),
            Some(Tensor::cat(&[&d_ck, &d_bk], 1)?),
            Some(Tensor::cat(&[&d_cv, &d_bv], 1)?),
        ))
    }
}

/// `x @ w^T` for `x` `[m, in]` and `w` `[out, in]`, as one graph node whose backward gives
/// `w` its gradient in `w`'s own layout (`dy^T @ x`): through candle's transpose, the gradient
/// arrives transposed and is added into a zeroed buffer element by element.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let out = x.detach().matmul(&w.detach().t()?)?;
    if !x.track_op() && !w.track_op() {
        return Ok(out);
    }
    x.apply_op2(w, LinearNode { out })
}

struct LinearNode {
    out: Tensor,
}

/// A copy of `t`'s storage: what a graph node computed untracked hands to candle.
fn handed_over<S: BackendStorage>(
    t: &Tensor,
    pick: impl Fn(&candle_core::Storage) -> Option<&S>,
) -> Result<(S, Shape)> {
    let (storage, layout) = t.storage_and_layout();
    let s = pick(&storage).ok_or_else(|| {
        candle_core::Error::Msg("a graph node's output is on another device".into())
    })?;
    Ok((s.try_clone(layout)?, layout.shape().clone()))
}

fn on_cpu(s: &candle_core::Storage) -> Option<&CpuStorage> {
    match s {
        candle_core::Storage::Cpu(c) => Some(c),
        _ => None,
    }
}

#[cfg(feature = "cuda")]
fn on_cuda(s: &candle_core::Storage) -> Option<&candle_core::CudaStorage> {
    match s {
        candle_core::Storage::Cuda(c) => Some(c),
        _ => None,
    }
}

impl CustomOp2 for LinearNode {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        handed_over(&self.out, on_cpu)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        handed_over(&self.out, on_cuda)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (x, w) = (x.detach(), w.detach());
        Ok((Some(dy.matmul(&w)?), Some(dy.t()?.matmul(&x)?)))
    }
}

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
    logits.contiguous()?.apply_op2(&labels, CrossEntropy)
}

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension (`weight`: `[n]`).
/// Differentiable in both.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let n = x.dim(candle_core::D::Minus1)?;
    if weight.dims() != [n] {
        bail!("rms_norm: weight {:?} for rows of {n}", weight.dims());
    }
    let weight = weight.to_dtype(x.dtype())?.contiguous()?;
    x.contiguous()?.apply_op2(&weight, RmsNorm { eps })
}

/// The rotate-half ("neox", Hugging Face) rotary embedding of `x` `[.., n, d]` by `cos`, `sin`
/// `[n, d / 2]`. Differentiable in `x`: the gradient is the inverse rotation.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let dims = x.dims();
    let (n, half) = cos.dims2()?;
    if dims.len() < 2 || dims[dims.len() - 2..] != [n, 2 * half] || sin.dims() != [n, half] {
        bail!(
            "rope: x {dims:?} with tables {:?} / {:?}",
            cos.dims(),
            sin.dims()
        );
    }
    let (cos, sin) = (
        cos.to_dtype(x.dtype())?.contiguous()?,
        sin.to_dtype(x.dtype())?.contiguous()?,
    );
    x.contiguous()?.apply_op3(&cos, &sin, Rope { sign: 1.0 })
}

/// `sum(x^2)` as a one-element f32 tensor, reduced on the device (no sync).
pub fn sum_squares(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&SumSquares)
}

/// The AdamW update of one parameter in place: `m` and `v` (f32, the parameter's shape) take
/// the clipped gradient `grad * clip_scale`, then `param` moves by the bias-corrected step and
/// decays by `lr * weight_decay` (PyTorch's order).
pub fn adamw_update(
    param: &Tensor,
    grad: &Tensor,
    m: &Tensor,
    v: &Tensor,
    step: &AdamStep,
) -> Result<()> {
    let grad = grad.contiguous()?;
    m.inplace_op2(
        &grad,
        &Moment {
            beta: step.betas.0 as f32,
            scale: step.clip_scale as f32,
            squared: false,
        },
    )?;
    v.inplace_op2(
        &grad,
        &Moment {
            beta: step.betas.1 as f32,
            scale: step.clip_scale as f32,
            squared: true,
        },
    )?;
    param.inplace_op3(m, v, step)
}

/// One AdamW step's constants.
#[derive(Clone, Debug)]
pub struct AdamStep {
    /// Learning rate.
    pub lr: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Betas.
    pub betas: (f64, f64),
    /// Bias corrections `1 - beta^t`.
    pub corrections: (f64, f64),
    /// Epsilon.
    pub eps: f64,
    /// What the gradient is multiplied by (global-norm clipping; 1 for none).
    pub clip_scale: f64,
}

struct MaskedSoftmax {
    scale: f64,
}

struct SoftmaxGrad {
    scale: f64,
}

struct CrossEntropy;

struct CrossEntropyGrad;

struct Moment {
    beta: f32,
    scale: f32,
    squared: bool,
}

struct RmsNorm {
    eps: f64,
}

struct RmsNormGrad {
    eps: f64,
}

struct Rope {
    sign: f64,
}

struct SumSquares;

/// The contiguous elements of a CPU tensor.
fn cpu<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("fused op: a non-contiguous input".into()))?;
    Ok(&s.as_slice::<T>()?[a..b])
}

/// The range of a contiguous tensor's elements in its storage.
fn span(l: &Layout) -> Result<std::ops::Range<usize>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("fused op: a non-contiguous input".into()))?;
    Ok(a..b)
}

/// The last dimension and the count of rows before it.
fn rows(l: &Layout) -> (usize, usize) {
    let n = l.dims().last().copied().unwrap_or(1);
    (l.shape().elem_count() / n.max(1), n)
}

/// Run `$f::<T>` for the float dtype `$dtype`, else fail naming `$what`.
macro_rules! by_float {
    ($dtype:expr, $what:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            d => bail!("{}: {d:?} is not a float type", $what),
        }
    };
}

fn softmax_cpu<T: WithDType>(x: &[T], mask: &[T], n: usize, nq: usize, scale: f64) -> CpuStorage {
    let mut out = vec![T::from_f64(0.0); x.len()];
    out.par_chunks_mut(n)
        .zip(x.par_chunks(n))
        .enumerate()
        .for_each(|(r, (y, x))| {
            let m = &mask[(r % nq) * n..(r % nq + 1) * n];
            let z = |j: usize| x[j].to_f64() * scale + m[j].to_f64();
            let max = (0..n).map(z).fold(f64::NEG_INFINITY, f64::max);
            if max == f64::NEG_INFINITY {
                return;
            }
            let sum: f64 = (0..n).map(|j| (z(j) - max).exp()).sum();
            for (j, y) in y.iter_mut().enumerate() {
                *y = T::from_f64((z(j) - max).exp() / sum);
            }
        });
    T::to_cpu_storage_owned(out)
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "masked-softmax"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, n) = rows(l1);
        let nq = l2.dims()[0];
        fn go<T: WithDType>(
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
            n: usize,
            nq: usize,
            scale: f64,
        ) -> Result<CpuStorage> {
            Ok(softmax_cpu(
                cpu::<T>(s1, l1)?,
                cpu::<T>(s2, l2)?,
                n,
                nq,
                scale,
            ))
        }
        let out = by_float!(
            s1.dtype(),
            self.name(),
            go(s1, l1, s2, l2, n, nq, self.scale)
        )?;
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::masked_softmax(s1, l1, s2, l2, self.scale as f32)?;
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _scores: &Tensor,
        _mask: &Tensor,
        probs: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = probs.apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxGrad { scale: self.scale })?;
        Ok((Some(g), None))
    }
}

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "masked-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, n) = rows(l1);
        fn go<T: WithDType>(
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
            n: usize,
            scale: f64,
        ) -> Result<CpuStorage> {
            let (p, dp) = (cpu::<T>(s1, l1)?, cpu::<T>(s2, l2)?);
            let mut out = vec![T::from_f64(0.0); p.len()];
            out.par_chunks_mut(n)
                .zip(p.par_chunks(n).zip(dp.par_chunks(n)))
                .for_each(|(ds, (p, dp))| {
                    let dot: f64 = p.iter().zip(dp).map(|(a, b)| a.to_f64() * b.to_f64()).sum();
                    for ((ds, p), dp) in ds.iter_mut().zip(p).zip(dp) {
                        *ds = T::from_f64(scale * p.to_f64() * (dp.to_f64() - dot));
                    }
                });
            Ok(T::to_cpu_storage_owned(out))
        }
        let out = by_float!(s1.dtype(), self.name(), go(s1, l1, s2, l2, n, self.scale))?;
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::softmax_grad(s1, l1, s2, l2, self.scale as f32)?;
        Ok((out, l1.shape().clone()))
    }
}

/// The dtype cross-entropy losses come out in.
fn loss_dtype(logits: DType) -> DType {
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

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, n) = rows(l1);
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
        let nll = by_float!(s1.dtype(), self.name(), go(s1, l1, labels, n))?;
        let out = match loss_dtype(s1.dtype()) {
            DType::F64 => CpuStorage::F64(nll),
            _ => CpuStorage::F32(nll.into_iter().map(|v| v as f32).collect()),
        };
        Ok((out, Shape::from(m)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (m, _) = rows(l1);
        Ok((cuda::cross_entropy(s1, l1, s2, l2)?, Shape::from(m)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        labels: &Tensor,
        _nll: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.to_dtype(loss_dtype(logits.dtype()))?.contiguous()?;
        let g = logits.apply_op3_no_bwd(labels, &grad, &CrossEntropyGrad)?;
        Ok((Some(g), None))
    }
}

impl CustomOp3 for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "cross-entropy-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
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
        let out = by_float!(s1.dtype(), self.name(), go(s1, l1, labels, &g, n))?;
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            cuda::cross_entropy_grad(s1, l1, s2, l2, s3, l3)?,
            l1.shape().clone(),
        ))
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, n) = rows(l1);
        fn go<T: WithDType>(
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
            n: usize,
            eps: f64,
        ) -> Result<CpuStorage> {
            let (x, w) = (cpu::<T>(s1, l1)?, cpu::<T>(s2, l2)?);
            let mut out = vec![T::from_f64(0.0); x.len()];
            out.par_chunks_mut(n)
                .zip(x.par_chunks(n))
                .for_each(|(y, x)| {
                    let r = rstd(x, eps);
                    for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                        *y = T::from_f64(x.to_f64() * r * w.to_f64());
                    }
                });
            Ok(T::to_cpu_storage_owned(out))
        }
        let out = by_float!(s1.dtype(), self.name(), go(s1, l1, s2, l2, n, self.eps))?;
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            cuda::rms_norm(s1, l1, s2, l2, self.eps as f32)?,
            l1.shape().clone(),
        ))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = dy.contiguous()?;
        let dx = x.apply_op3_no_bwd(w, &dy, &RmsNormGrad { eps: self.eps })?;
        // dw = sum over rows of dy * x * rstd: composed, it is one [n] reduction.
        let n = w.dim(0)?;
        let wide = super::ops::wide(x.dtype());
        let x = x.to_dtype(wide)?.reshape(((), n))?;
        let r = (x.sqr()?.mean_keepdim(1)? + self.eps)?.sqrt()?.recip()?;
        let dw = (dy.to_dtype(wide)?.reshape(((), n))? * x.broadcast_mul(&r)?)?
            .sum(0)?
            .to_dtype(w.dtype())?;
        Ok((Some(dx), Some(dw)))
    }
}

/// `1 / sqrt(mean(x^2) + eps)` of a row, in f64.
fn rstd<T: WithDType>(x: &[T], eps: f64) -> f64 {
    let ms = x.iter().map(|v| v.to_f64().powi(2)).sum::<f64>() / x.len() as f64;
    1.0 / (ms + eps).sqrt()
}

impl CustomOp3 for RmsNormGrad {
    fn name(&self) -> &'static str {
        "rms-norm-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, n) = rows(l1);
        fn go<T: WithDType>(
            (s1, l1): (&CpuStorage, &Layout),
            (s2, l2): (&CpuStorage, &Layout),
            (s3, l3): (&CpuStorage, &Layout),
            n: usize,
            eps: f64,
        ) -> Result<CpuStorage> {
            let (x, w, dy) = (cpu::<T>(s1, l1)?, cpu::<T>(s2, l2)?, cpu::<T>(s3, l3)?);
            let mut out = vec![T::from_f64(0.0); x.len()];
            out.par_chunks_mut(n)
                .zip(x.par_chunks(n).zip(dy.par_chunks(n)))
                .for_each(|(dx, (x, dy))| {
                    let r = rstd(x, eps);
                    let dot: f64 = (0..n)
                        .map(|j| dy[j].to_f64() * w[j].to_f64() * x[j].to_f64())
                        .sum();
                    let c = dot / n as f64 * r * r * r;
                    for (j, dx) in dx.iter_mut().enumerate() {
                        *dx = T::from_f64(r * dy[j].to_f64() * w[j].to_f64() - x[j].to_f64() * c);
                    }
                });
            Ok(T::to_cpu_storage_owned(out))
        }
        let out = by_float!(
            s1.dtype(),
            self.name(),
            go((s1, l1), (s2, l2), (s3, l3), n, self.eps)
        )?;
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            cuda::rms_norm_grad((s1, l1), (s2, l2), (s3, l3), self.eps as f32)?,
            l1.shape().clone(),
        ))
    }
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = l1.dims();
        let (n, d) = (dims[dims.len() - 2], dims[dims.len() - 1]);
        fn go<T: WithDType>(
            (s1, l1): (&CpuStorage, &Layout),
            (s2, l2): (&CpuStorage, &Layout),
            (s3, l3): (&CpuStorage, &Layout),
            n: usize,
            d: usize,
            sign: f64,
        ) -> Result<CpuStorage> {
            let (x, cos, sin) = (cpu::<T>(s1, l1)?, cpu::<T>(s2, l2)?, cpu::<T>(s3, l3)?);
            let half = d / 2;
            let mut out = vec![T::from_f64(0.0); x.len()];
            out.par_chunks_mut(d)
                .zip(x.par_chunks(d))
                .enumerate()
                .for_each(|(row, (y, x))| {
                    let t = row % n;
                    for k in 0..half {
                        let c = cos[t * half + k].to_f64();
                        let s = sign * sin[t * half + k].to_f64();
                        let (a, b) = (x[k].to_f64(), x[k + half].to_f64());
                        y[k] = T::from_f64(a * c - b * s);
                        y[k + half] = T::from_f64(b * c + a * s);
                    }
                });
            Ok(T::to_cpu_storage_owned(out))
        }
        let out = by_float!(
            s1.dtype(),
            self.name(),
            go((s1, l1), (s2, l2), (s3, l3), n, d, self.sign)
        )?;
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            cuda::rope((s1, l1), (s2, l2), (s3, l3), self.sign as f32)?,
            l1.shape().clone(),
        ))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let back = Rope { sign: -self.sign };
        Ok((
            Some(dy.contiguous()?.apply_op3_no_bwd(cos, sin, &back)?),
            None,
            None,
        ))
    }
}

impl candle_core::CustomOp1 for SumSquares {
    fn name(&self) -> &'static str {
        "sum-squares"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        fn go<T: WithDType>(s: &CpuStorage, l: &Layout) -> Result<f64> {
            Ok(cpu::<T>(s, l)?.par_iter().map(|v| v.to_f64().powi(2)).sum())
        }
        let total = by_float!(s.dtype(), self.name(), go(s, l))?;
        Ok((CpuStorage::F32(vec![total as f32]), Shape::from(1)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((cuda::sum_squares(s, l)?, Shape::from(1)))
    }
}

/// The mutable f32 elements of an optimizer moment.
fn moment_slice<'a>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [f32]> {
    let r = span(l)?;
    match s {
        CpuStorage::F32(v) => Ok(&mut v[r]),
        other => bail!("AdamW moments are f32, not {:?}", other.dtype()),
    }
}

impl InplaceOp2 for Moment {
    fn name(&self) -> &'static str {
        "adamw-moment"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        fn go<T: WithDType>(m: &mut [f32], g: &CpuStorage, l: &Layout, op: &Moment) -> Result<()> {
            let g = cpu::<T>(g, l)?;
            if g.len() != m.len() {
                bail!(
                    "adamw-moment: {} gradient elements for {}",
                    g.len(),
                    m.len()
                );
            }
            m.par_iter_mut().zip(g.par_iter()).for_each(|(m, g)| {
                let x = g.to_f64() as f32 * op.scale;
                *m = op.beta * *m + (1.0 - op.beta) * if op.squared { x * x } else { x };
            });
            Ok(())
        }
        let m = moment_slice(s1, l1)?;
        by_float!(s2.dtype(), self.name(), go(m, s2, l2, self))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        cuda::moment(s1, l1, s2, l2, self.beta, self.scale, self.squared)
    }
}

impl InplaceOp3 for AdamStep {
    fn name(&self) -> &'static str {
        "adamw-apply"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<()> {
        let (m, v) = (cpu::<f32>(s2, l2)?, cpu::<f32>(s3, l3)?);
        let r = span(l1)?;
        fn go<T: WithDType + Send + Sync>(p: &mut [T], m: &[f32], v: &[f32], s: &AdamStep) {
            let (lr, decay) = (s.lr as f32, 1.0 - (s.lr * s.weight_decay) as f32);
            let (c1, c2, eps) = (s.corrections.0 as f32, s.corrections.1 as f32, s.eps as f32);
            p.par_iter_mut()
                .zip(m.par_iter().zip(v.par_iter()))
                .for_each(|(p, (m, v))| {
                    let x = p.to_f64() as f32 * decay;
                    *p = T::from_f64(f64::from(x - lr * (m / c1) / ((v / c2).sqrt() + eps)));
                });
        }
        let n = r.len();
        if m.len() != n || v.len() != n {
            bail!(
                "adamw-apply: moments of {} and {} elements for {n}",
                m.len(),
                v.len()
            );
        }
        match s1 {
            CpuStorage::F32(p) => go(&mut p[r], m, v, self),
            CpuStorage::F64(p) => go(&mut p[r], m, v, self),
            CpuStorage::BF16(p) => go(&mut p[r], m, v, self),
            CpuStorage::F16(p) => go(&mut p[r], m, v, self),
            other => bail!("adamw-apply: {:?} parameters", other.dtype()),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<()> {
        cuda::adam_apply(s1, l1, s2, l2, s3, l3, self)
    }
}

/// Launches of the kernels in `kernels.cu` (compiled to PTX by `build.rs`). A kernel launch is
/// FFI, hence `unsafe`; each states what it reads and writes, all of it allocated or checked here.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaFunction, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaDevice, CudaStorage, DType, Layout, WithDType, bail};

    use super::{AdamStep, Result, rows, span};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));

    fn kernel(dev: &CudaDevice, name: &str, dtype: DType) -> Result<CudaFunction> {
        let suffix = match dtype {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            d => bail!("{name}: no CUDA kernel for {d:?} (f32 and bf16 have one)"),
        };
        Ok(dev
            .get_or_load_custom_func(&format!("{name}_{suffix}"), "dflash_fused", PTX)?
            .into_cuda_function())
    }

    /// One block per row, as many threads as the row has elements up to 1024.
    fn per_row(rows: usize, n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (n.next_multiple_of(32).clamp(32, 1024) as u32, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// A grid-stride loop over `n` elements.
    fn elementwise(n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n.div_ceil(256).clamp(1, 1 << 16) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// A grid-stride reduction: few enough blocks that their atomic adds are cheap.
    fn reducing(n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n.div_ceil(256).clamp(1, 1024) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    macro_rules! by_type {
        ($dtype:expr, $what:expr, $f:ident ( $($arg:expr),* )) => {
            match $dtype {
                DType::F32 => $f::<f32>($($arg),*),
                DType::BF16 => $f::<half::bf16>($($arg),*),
                d => bail!("{}: no CUDA kernel for {d:?} (f32 and bf16 have one)", $what),
            }
        };
    }

    pub fn masked_softmax(
        s: &CudaStorage,
        l: &Layout,
        mask: &CudaStorage,
        lm: &Layout,
        scale: f32,
    ) -> Result<CudaStorage> {
        fn go<T: CudaDType + DeviceRepr + WithDType>(
            s: &CudaStorage,
            l: &Layout,
            mask: &CudaStorage,
            lm: &Layout,
            scale: f32,
        ) -> Result<CudaStorage> {
            let dev = s.device();
            let (count, n) = rows(l);
            let x = s.as_cuda_slice::<T>()?.slice(span(l)?);
            let m = mask.as_cuda_slice::<T>()?.slice(span(lm)?);
            let out = unsafe { dev.alloc::<T>(count * n)? };
            let (n32, nq) = (n as u32, lm.dims()[0] as u32);
            let f = kernel(dev, "masked_softmax", T::DTYPE)?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&x).arg(&m).arg(&out).arg(&n32).arg(&nq).arg(&scale);
            // SAFETY: the kernel reads count*n and nq*n elements and writes count*n.
            unsafe { b.launch(per_row(count, n)) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        by_type!(s.dtype(), "masked-softmax", go(s, l, mask, lm, scale))
    }

    pub fn softmax_grad(
        p: &CudaStorage,
        lp: &Layout,
        dp: &CudaStorage,
        ldp: &Layout,
        scale: f32,
    ) -> Result<CudaStorage> {
        fn go<T: CudaDType + DeviceRepr + WithDType>(
            p: &CudaStorage,
            lp: &Layout,
            dp: &CudaStorage,
            ldp: &Layout,
            scale: f32,
        ) -> Result<CudaStorage> {
            let dev = p.device();
            let (count, n) = rows(lp);
            let ps = p.as_cuda_slice::<T>()?.slice(span(lp)?);
            let dps = dp.as_cuda_slice::<T>()?.slice(span(ldp)?);
            let out = unsafe { dev.alloc::<T>(count * n)? };
            let n32 = n as u32;
            let f = kernel(dev, "softmax_grad", T::DTYPE)?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&ps).arg(&dps).arg(&out).arg(&n32).arg(&scale);
            // SAFETY: reads and writes count*n elements of each.
            unsafe { b.launch(per_row(count, n)) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        by_type!(p.dtype(), "masked-softmax-grad", go(p, lp, dp, ldp, scale))
    }

    pub fn cross_entropy(
        z: &CudaStorage,
        lz: &Layout,
        y: &CudaStorage,
        ly: &Layout,
    ) -> Result<CudaStorage> {
        fn go<T: CudaDType + DeviceRepr + WithDType>(
            z: &CudaStorage,
            lz: &Layout,
            y: &CudaStorage,
            ly: &Layout,
        ) -> Result<CudaStorage> {
            let dev = z.device();
            let (count, n) = rows(lz);
            let zs = z.as_cuda_slice::<T>()?.slice(span(lz)?);
            let ys = y.as_cuda_slice::<u32>()?.slice(span(ly)?);
            let out = unsafe { dev.alloc::<f32>(count)? };
            let n32 = n as u32;
            let f = kernel(dev, "cross_entropy", T::DTYPE)?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&zs).arg(&ys).arg(&out).arg(&n32);
            // SAFETY: reads count*n logits and count labels (checked < n), writes count.
            unsafe { b.launch(per_row(count, n)) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        by_type!(z.dtype(), "cross-entropy", go(z, lz, y, ly))
    }

    pub fn cross_entropy_grad(
        z: &CudaStorage,
        lz: &Layout,
        y: &CudaStorage,
        ly: &Layout,
        g: &CudaStorage,
        lg: &Layout,
    ) -> Result<CudaStorage> {
        fn go<T: CudaDType + DeviceRepr + WithDType>(
            z: &CudaStorage,
            lz: &Layout,
            y: &CudaStorage,
            ly: &Layout,
            g: &CudaStorage,
            lg: &Layout,
        ) -> Result<CudaStorage> {
            let dev = z.device();
            let (count, n) = rows(lz);
            let zs = z.as_cuda_slice::<T>()?.slice(span(lz)?);
            let ys = y.as_cuda_slice::<u32>()?.slice(span(ly)?);
            let gs = g.as_cuda_slice::<f32>()?.slice(span(lg)?);
            let out = unsafe { dev.alloc::<T>(count * n)? };
            let n32 = n as u32;
            let f = kernel(dev, "cross_entropy_grad", T::DTYPE)?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&zs).arg(&ys).arg(&gs).arg(&out).arg(&n32);
            // SAFETY: reads count*n logits, count labels and gradients; writes count*n.
            unsafe { b.launch(per_row(count, n)) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        by_type!(z.dtype(), "cross-entropy-grad", go(z, lz, y, ly, g, lg))
    }

    pub fn rms_norm(
        x: &CudaStorage,
        lx: &Layout,
        w: &CudaStorage,
        lw: &Layout,
        eps: f32,
    ) -> Result<CudaStorage> {
        fn go<T: CudaDType + DeviceRepr + WithDType>(
            x: &CudaStorage,
            lx: &Layout,
            w: &CudaStorage,
            lw: &Layout,
            eps: f32,
        ) -> Result<CudaStorage> {
            let dev = x.device();
            let (count, n) = rows(lx);
            let xs = x.as_cuda_slice::<T>()?.slice(span(lx)?);
            let ws = w.as_cuda_slice::<T>()?.slice(span(lw)?);
            let out = unsafe { dev.alloc::<T>(count * n)? };
            let n32 = n as u32;
            let f = kernel(dev, "rms_norm", T::DTYPE)?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&xs).arg(&ws).arg(&out).arg(&n32).arg(&eps);
            // SAFETY: reads count*n and n elements, writes count*n.
            unsafe { b.launch(per_row(count, n)) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        by_type!(x.dtype(), "rms-norm", go(x, lx, w, lw, eps))
    }

    type Arg<'a> = (&'a CudaStorage, &'a Layout);

    pub fn rms_norm_grad(x: Arg<'_>, w: Arg<'_>, dy: Arg<'_>, eps: f32) -> Result<CudaStorage> {
        fn go<T: CudaDType + DeviceRepr + WithDType>(
            (x, lx): Arg<'_>,
            (w, lw): Arg<'_>,
            (dy, ldy): Arg<'_>,
            eps: f32,
        ) -> Result<CudaStorage> {
            let dev = x.device();
            let (count, n) = rows(lx);
            let xs = x.as_cuda_slice::<T>()?.slice(span(lx)?);
            let ws = w.as_cuda_slice::<T>()?.slice(span(lw)?);
            let dys = dy.as_cuda_slice::<T>()?.slice(span(ldy)?);
            let out = unsafe { dev.alloc::<T>(count * n)? };
            let n32 = n as u32;
            let f = kernel(dev, "rms_norm_grad", T::DTYPE)?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&xs).arg(&ws).arg(&dys).arg(&out).arg(&n32).arg(&eps);
            // SAFETY: reads count*n, n and count*n elements, writes count*n.
            unsafe { b.launch(per_row(count, n)) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        by_type!(x.0.dtype(), "rms-norm-grad", go(x, w, dy, eps))
    }

    pub fn rope(x: Arg<'_>, cos: Arg<'_>, sin: Arg<'_>, sign: f32) -> Result<CudaStorage> {
        fn go<T: CudaDType + DeviceRepr + WithDType>(
            (x, lx): Arg<'_>,
            (c, lc): Arg<'_>,
            (s, ls): Arg<'_>,
            sign: f32,
        ) -> Result<CudaStorage> {
            let dev = x.device();
            let dims = lx.dims();
            let (n, d) = (dims[dims.len() - 2] as u32, dims[dims.len() - 1] as u32);
            let total = lx.shape().elem_count();
            let xs = x.as_cuda_slice::<T>()?.slice(span(lx)?);
            let cs = c.as_cuda_slice::<T>()?.slice(span(lc)?);
            let ss = s.as_cuda_slice::<T>()?.slice(span(ls)?);
            let out = unsafe { dev.alloc::<T>(total)? };
            let f = kernel(dev, "rope", T::DTYPE)?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&xs)
                .arg(&cs)
                .arg(&ss)
                .arg(&out)
                .arg(&total)
                .arg(&n)
                .arg(&d)
                .arg(&sign);
            // SAFETY: reads `total` elements and two n*d/2 tables, writes `total`.
            unsafe { b.launch(elementwise(total)) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        by_type!(x.0.dtype(), "rope", go(x, cos, sin, sign))
    }

    pub fn sum_squares(x: &CudaStorage, lx: &Layout) -> Result<CudaStorage> {
        fn go<T: CudaDType + DeviceRepr + WithDType>(
            x: &CudaStorage,
            lx: &Layout,
        ) -> Result<CudaStorage> {
            let dev = x.device();
            let n = lx.shape().elem_count();
            let xs = x.as_cuda_slice::<T>()?.slice(span(lx)?);
            let out = dev.alloc_zeros::<f32>(1)?;
            let f = kernel(dev, "sum_squares", T::DTYPE)?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&xs).arg(&n).arg(&out);
            // SAFETY: reads n elements, adds into one.
            unsafe { b.launch(reducing(n)) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        by_type!(x.dtype(), "sum-squares", go(x, lx))
    }

    pub fn moment(
        m: &mut CudaStorage,
        lm: &Layout,
        g: &CudaStorage,
        lg: &Layout,
        beta: f32,
        scale: f32,
        squared: bool,
    ) -> Result<()> {
        fn go<T: CudaDType + DeviceRepr + WithDType>(
            m: &mut CudaStorage,
            lm: &Layout,
            g: &CudaStorage,
            lg: &Layout,
            beta: f32,
            scale: f32,
            squared: i32,
        ) -> Result<()> {
            let dev = g.device().clone();
            let r = span(lm)?;
            let n = r.len();
            if span(lg)?.len() != n {
                bail!("adamw-moment: gradient and moment sizes differ");
            }
            let gs = g.as_cuda_slice::<T>()?.slice(span(lg)?);
            let mut ms = m.as_cuda_slice_mut::<f32>()?.slice_mut(r);
            let f = kernel(&dev, "moment", T::DTYPE)?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&mut ms)
                .arg(&gs)
                .arg(&n)
                .arg(&beta)
                .arg(&scale)
                .arg(&squared);
            // SAFETY: n elements of each.
            unsafe { b.launch(elementwise(n)) }.w()?;
            Ok(())
        }
        let squared = i32::from(squared);
        by_type!(
            g.dtype(),
            "adamw-moment",
            go(m, lm, g, lg, beta, scale, squared)
        )
    }

    pub fn adam_apply(
        p: &mut CudaStorage,
        lp: &Layout,
        m: &CudaStorage,
        lm: &Layout,
        v: &CudaStorage,
        lv: &Layout,
        s: &AdamStep,
    ) -> Result<()> {
        fn go<T: CudaDType + DeviceRepr + WithDType>(
            p: &mut CudaStorage,
            lp: &Layout,
            m: &CudaStorage,
            lm: &Layout,
            v: &CudaStorage,
            lv: &Layout,
            s: &AdamStep,
        ) -> Result<()> {
            let dev = m.device().clone();
            let r = span(lp)?;
            let n = r.len();
            if span(lm)?.len() != n || span(lv)?.len() != n {
                bail!("adamw-apply: parameter and moment sizes differ");
            }
            let ms = m.as_cuda_slice::<f32>()?.slice(span(lm)?);
            let vs = v.as_cuda_slice::<f32>()?.slice(span(lv)?);
            let mut ps = p.as_cuda_slice_mut::<T>()?.slice_mut(r);
            let (lr, decay) = (s.lr as f32, s.weight_decay as f32);
            let (c1, c2, eps) = (s.corrections.0 as f32, s.corrections.1 as f32, s.eps as f32);
            let f = kernel(&dev, "adam_apply", T::DTYPE)?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&mut ps)
                .arg(&ms)
                .arg(&vs)
                .arg(&n)
                .arg(&lr)
                .arg(&decay);
            b.arg(&c1).arg(&c2).arg(&eps);
            // SAFETY: n elements of each.
            unsafe { b.launch(elementwise(n)) }.w()?;
            Ok(())
        }
        by_type!(p.dtype(), "adamw-apply", go(p, lp, m, lm, v, lv, s))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{D, Device, Var};

    use super::*;
    use crate::nn::ops;

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        crate::nn::drafter::Init::new(seed)
            .normal(shape, 1.0, DType::F64, &Device::Cpu)
            .expect("cpu")
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    }

    /// A mask with a fully masked row and a row that sees one key.
    fn mask(nq: usize, nk: usize) -> Tensor {
        let v: Vec<f64> = (0..nq * nk)
            .map(|i| {
                let (r, c) = (i / nk, i % nk);
                let open = r != 1 && (r == 2 && c == 0 || r != 2 && (c + r) % 3 != 0);
                if open { 0.0 } else { f64::NEG_INFINITY }
            })
            .collect();
        Tensor::from_vec(v, (nq, nk), &Device::Cpu).unwrap()
    }

    #[test]
    fn masked_softmax_and_its_gradient_match_the_composed_ops() {
        let (nq, nk, scale) = (5, 7, 0.3);
        let x = Var::from_tensor(&randn(&[2, nq, nk], 1)).unwrap();
        let w = randn(&[2, nq, nk], 2);
        let mask = mask(nq, nk);
        let fused = masked_softmax(x.as_tensor(), &mask, scale).unwrap();
        let fused_grads = (&fused * &w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();

        let z = (x.as_tensor() * scale)
            .unwrap()
            .broadcast_add(&mask)
            .unwrap();
        let composed = ops::softmax_last(&z).unwrap();
        // The composed softmax gives NaN on the fully masked row; the fused op gives zeros.
        let row1 = |t: &Tensor| t.narrow(D::Minus2, 1, 1).unwrap();
        assert_eq!(
            max_diff(&row1(&fused), &row1(&fused).zeros_like().unwrap()),
            0.0
        );
        let keep = |t: &Tensor| {
            Tensor::cat(
                &[
                    t.narrow(D::Minus2, 0, 1).unwrap(),
                    t.narrow(D::Minus2, 2, nq - 2).unwrap(),
                ],
                D::Minus2,
            )
            .unwrap()
        };
        let d = max_diff(&keep(&fused), &keep(&composed));
        assert!(d < 1e-12, "{d}: {fused} vs {composed}");
        let composed_grads = (&keep(&composed) * &keep(&w))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (gf, gc) = (
            fused_grads.get(x.as_tensor()).unwrap(),
            composed_grads.get(x.as_tensor()).unwrap(),
        );
        assert!(max_diff(&keep(gf), &keep(gc)) < 1e-12, "{gf} vs {gc}");
        assert_eq!(max_diff(&row1(gf), &row1(gf).zeros_like().unwrap()), 0.0);
    }

    #[test]
    fn cross_entropy_and_its_gradient_match_the_composed_ops() {
        let z = Var::from_tensor(&randn(&[4, 9], 3)).unwrap();
        let labels = [0u32, 8, 3, 3];
        let w = Tensor::new(&[1.0f64, 0.5, 0.0, 2.0], &Device::Cpu).unwrap();
        let fused = cross_entropy(z.as_tensor(), &labels).unwrap();
        let gf = (&fused * &w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let y = Tensor::new(&labels, &Device::Cpu)
            .unwrap()
            .unsqueeze(1)
            .unwrap();
        let composed = ops::log_softmax_last(z.as_tensor())
            .unwrap()
            .gather(&y, 1)
            .unwrap()
            .squeeze(1)
            .unwrap()
            .neg()
            .unwrap();
        assert!(max_diff(&fused, &composed) < 1e-12);
        let gc = (&composed * &w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (gf, gc) = (
            gf.get(z.as_tensor()).unwrap(),
            gc.get(z.as_tensor()).unwrap(),
        );
        assert!(max_diff(gf, gc) < 1e-12, "{gf} vs {gc}");
        assert!(cross_entropy(z.as_tensor(), &[0, 9, 0, 0]).is_err());
    }

    #[test]
    fn the_adamw_update_is_pytorchs() {
        // One step by hand: m = 0.1 g, v = 0.001 g^2, p' = p (1 - lr wd) - lr m^ / (sqrt(v^) + eps).
        let p = Tensor::new(&[1.0f32, -2.0, 0.5], &Device::Cpu).unwrap();
        let g = Tensor::new(&[0.5f32, 0.25, -4.0], &Device::Cpu).unwrap();
        let (m, v) = (p.zeros_like().unwrap(), p.zeros_like().unwrap());
        let step = AdamStep {
            lr: 0.1,
            weight_decay: 0.01,
            betas: (0.9, 0.999),
            corrections: (0.1, 0.001),
            eps: 1e-8,
            clip_scale: 0.5,
        };
        adamw_update(&p, &g, &m, &v, &step).unwrap();
        let got = p.to_vec1::<f32>().unwrap();
        for (i, (&p0, &g0)) in [1.0f32, -2.0, 0.5]
            .iter()
            .zip(&[0.5f32, 0.25, -4.0])
            .enumerate()
        {
            let g = f64::from(g0) * 0.5;
            let (mh, vh) = (0.1 * g / 0.1, 0.001 * g * g / 0.001);
            let want = f64::from(p0) * (1.0 - 0.1 * 0.01) - 0.1 * mh / (vh.sqrt() + 1e-8);
            assert!(
                (f64::from(got[i]) - want).abs() < 1e-6,
                "{i}: {} vs {want}",
                got[i]
            );
        }
        assert!((m.to_vec1::<f32>().unwrap()[2] - 0.1 * -2.0).abs() < 1e-7);
    }

    /// Value and gradients of `sum(f(x, w) * up)` with `x` and `w` as variables.
    fn grads_of(
        f: &dyn Fn(&Tensor, &Tensor) -> Tensor,
        x: &Tensor,
        w: &Tensor,
        up: &Tensor,
    ) -> (Tensor, Tensor, Tensor) {
        let (xv, wv) = (Var::from_tensor(x).unwrap(), Var::from_tensor(w).unwrap());
        let y = f(xv.as_tensor(), wv.as_tensor());
        let g = (&y * up).unwrap().sum_all().unwrap().backward().unwrap();
        let gx = g.get(xv.as_tensor()).unwrap().clone();
        let gw = g
            .get(wv.as_tensor())
            .map_or_else(|| w.zeros_like().unwrap(), Clone::clone);
        (y, gx, gw)
    }

    #[test]
    fn rms_norm_and_rope_and_their_gradients_match_the_composed_ops() {
        let x = randn(&[3, 5, 8], 4);
        let up = randn(&[3, 5, 8], 5);
        let w = randn(&[8], 6);
        let composed_norm = |x: &Tensor, w: &Tensor| {
            let r = (x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap() + 1e-6)
                .unwrap()
                .sqrt()
                .unwrap()
                .recip()
                .unwrap();
            x.broadcast_mul(&r).unwrap().broadcast_mul(w).unwrap()
        };
        let a = grads_of(&|x, w| rms_norm(x, w, 1e-6).unwrap(), &x, &w, &up);
        let b = grads_of(&composed_norm, &x, &w, &up);
        for (p, q) in [(&a.0, &b.0), (&a.1, &b.1), (&a.2, &b.2)] {
            assert!(max_diff(p, q) < 1e-12, "{p} vs {q}");
        }
        let (cos, sin) =
            ops::rope_tables(&[3, 9, 1, 0, 7], 8, 10_000.0, DType::F64, &Device::Cpu).unwrap();
        let composed_rope = |x: &Tensor, _: &Tensor| {
            let (x1, x2) = (
                x.narrow(D::Minus1, 0, 4).unwrap(),
                x.narrow(D::Minus1, 4, 4).unwrap(),
            );
            let c = Tensor::cat(&[&cos, &cos], D::Minus1).unwrap();
            let s = Tensor::cat(&[&sin, &sin], D::Minus1).unwrap();
            let rotated = Tensor::cat(&[&x2.neg().unwrap(), &x1], D::Minus1).unwrap();
            (x.broadcast_mul(&c).unwrap() + rotated.broadcast_mul(&s).unwrap()).unwrap()
        };
        let a = grads_of(&|x, _| rope(x, &cos, &sin).unwrap(), &x, &w, &up);
        let b = grads_of(&composed_rope, &x, &w, &up);
        assert!(max_diff(&a.0, &b.0) < 1e-12 && max_diff(&a.1, &b.1) < 1e-12);
        let total = sum_squares(&x).unwrap().to_vec1::<f32>().unwrap()[0];
        let want = x
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        assert!((f64::from(total) - want).abs() < 1e-4 * want);
    }
}
