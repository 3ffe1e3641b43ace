//! The AdamW update in place (f32 or bf16 moments) and the gradients' squared norm.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Shape, Tensor, WithDType, bail,
};
use rayon::prelude::*;

use super::{CpuArg, Result, cpu, span};

/// `sum(x^2)` as a one-element f32 tensor, reduced on the device (no sync).
pub fn sum_squares(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&SumSquares {})
}

/// The AdamW update of one parameter in place: `m` and `v` (f32, the parameter's shape) take
/// the clipped gradient `grad * clip_scale`, then `param` moves by the bias-corrected step and
/// decays by `lr * weight_decay` (PyTorch's order). On a GPU one kernel does all three.
/// Moments in bf16 are stepped in f32 and stored back by stochastic rounding
/// ([`round_stochastic`]): on a GPU in the same one kernel (`adamw_sr_T`), on CPU on the host.
pub fn adamw_update(
    param: &Tensor,
    grad: &Tensor,
    m: &Tensor,
    v: &Tensor,
    step: &AdamStep,
) -> Result<()> {
    let grad = grad.contiguous()?;
    // On a GPU one pass over the four (issue 22: 18.3 ms against PyTorch's fused 10.0 at the
    // Qwen3-8B shape), bf16 moments or f32; the CPU keeps its three in-place ops, bit for bit.
    #[cfg(feature = "cuda")]
    if param.device().is_cuda() {
        return super::cuda::adamw_fused(param, &grad, m, v, step);
    }
    if m.dtype() == DType::BF16 {
        return adamw_bf16_moments_host(param, &grad, m, v, None, step);
    }
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

/// [`adamw_update`] of f32 master weights `param` from a gradient in the step's dtype, then
/// `low` (the weights in that dtype, what the next step computes with) made the updated
/// weights' copy, as a cast would make it. On a GPU with a bf16 gradient one kernel does it all
/// (`adamw_master_bf16`), reading the bf16 gradient as it is; elsewhere the gradient is cast up,
/// the update runs, and the weights are cast into `low`.
pub fn adamw_update_master(
    param: &Tensor,
    grad: &Tensor,
    m: &Tensor,
    v: &Tensor,
    low: &Tensor,
    step: &AdamStep,
) -> Result<()> {
    let grad = grad.contiguous()?;
    #[cfg(feature = "cuda")]
    if param.device().is_cuda()
        && (param.dtype(), grad.dtype(), low.dtype()) == (DType::F32, DType::BF16, DType::BF16)
    {
        return super::cuda::adamw_master(param, &grad, m, v, low, step);
    }
    if m.dtype() == DType::BF16 {
        return adamw_bf16_moments_host(param, &grad, m, v, Some(low), step);
    }
    adamw_update(param, &grad.to_dtype(param.dtype())?, m, v, step)?;
    low.slice_set(&param.to_dtype(low.dtype())?, 0, 0)
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
    /// Where the moments are bf16: the seed of their stochastic rounding ([`coin`]), one per
    /// parameter and step (unread for f32 moments).
    pub rounding_seed: u32,
}

/// The coin of stochastic rounding: a 32-bit mix of `x` (kernels.cu's `mix32`, bit for bit, so
/// CPU and GPU round alike).
pub fn coin(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^= x >> 16;
    x
}

/// `x` rounded to bf16 stochastically: the 16 dropped bits plus the low 16 of
/// `coin(index ^ seed)` carry into the kept ones (kernels.cu's `round_stochastic`); infinities
/// and NaN as they are.
pub fn round_stochastic(x: f32, index: u32, seed: u32) -> half::bf16 {
    let mut b = x.to_bits();
    if b & 0x7f80_0000 != 0x7f80_0000 {
        b = b.wrapping_add(coin(index ^ seed) & 0xffff);
    }
    half::bf16::from_bits((b >> 16) as u16)
}

/// The seeds of a parameter's two moments from [`AdamStep::rounding_seed`].
pub(super) fn moment_seeds(seed: u32) -> (u32, u32) {
    (coin(seed), coin(seed ^ 0x5bd1_e995))
}

/// AdamW with bf16 moments (read up, stepped in f32, written back by [`round_stochastic`]) on
/// the host: `param` f32 (or any float), `low` its cast where given. What a GPU's `adamw_sr_T`
/// and `adamw_master_sr_bf16` do, element for element (their arithmetic in f32 in the same
/// order; their fused multiply-adds may differ in the last bit).
fn adamw_bf16_moments_host(
    param: &Tensor,
    grad: &Tensor,
    m: &Tensor,
    v: &Tensor,
    low: Option<&Tensor>,
    step: &AdamStep,
) -> Result<()> {
    let flat = |t: &Tensor| t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>();
    let (mut p, g, mut mm, mut vv) = (flat(param)?, flat(grad)?, flat(m)?, flat(v)?);
    let n = p.len();
    if g.len() != n || mm.len() != n || vv.len() != n {
        bail!("adamw: parameter, gradient and moment sizes differ");
    }
    let (b1, b2, scale) = (
        step.betas.0 as f32,
        step.betas.1 as f32,
        step.clip_scale as f32,
    );
    let (lr, decay) = (step.lr as f32, 1.0 - (step.lr * step.weight_decay) as f32);
    let (c1, c2, eps) = (
        step.corrections.0 as f32,
        step.corrections.1 as f32,
        step.eps as f32,
    );
    let (seed_m, seed_v) = moment_seeds(step.rounding_seed);
    let (mut m16, mut v16) = (vec![half::bf16::ZERO; n], vec![half::bf16::ZERO; n]);
    p.par_iter_mut()
        .zip(mm.par_iter_mut().zip(vv.par_iter_mut()))
        .zip(m16.par_iter_mut().zip(v16.par_iter_mut()))
        .enumerate()
        .for_each(|(i, ((p, (m, v)), (m16, v16)))| {
            let x = g[i] * scale;
            *m = b1 * *m + (1.0 - b1) * x;
            *v = b2 * *v + (1.0 - b2) * (x * x);
            *p = *p * decay - lr * (*m / c1) / ((*v / c2).sqrt() + eps);
            // Indices as the kernel's (u32, wrapping past 4G elements).
            *m16 = round_stochastic(*m, i as u32, seed_m);
            *v16 = round_stochastic(*v, i as u32, seed_v);
        });
    let (shape, device) = (param.shape().clone(), param.device());
    let put = |into: &Tensor, t: Tensor| -> Result<()> {
        into.slice_set(&t.reshape(shape.clone())?.to_dtype(into.dtype())?, 0, 0)
    };
    put(m, Tensor::from_vec(m16, n, device)?)?;
    put(v, Tensor::from_vec(v16, n, device)?)?;
    let p = Tensor::from_vec(p, n, device)?;
    if let Some(low) = low {
        put(low, p.to_dtype(low.dtype())?)?;
    }
    put(param, p)
}

struct Moment {
    beta: f32,
    scale: f32,
    squared: bool,
}

fused_op! {
    /// The sum of the squares of every element, one f32 (the gradient norm's pieces).
    SumSquares {} = "sum-squares", inputs(x);
    cpu(_op) => {
        fn go<T: WithDType>((s, l): CpuArg<'_>) -> Result<f64> {
            Ok(cpu::<T>(s, l)?.par_iter().map(|v| v.to_f64().powi(2)).sum())
        }
        let total = by_float!(x.0.dtype(), "sum-squares", go(x))?;
        Ok((CpuStorage::F32(vec![total as f32]), Shape::from(1)))
    };
    cuda(_op) => Ok((super::cuda::sum_squares(x)?, Shape::from(1)));
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
        super::cuda::moment(s1, l1, (s2, l2), self.beta, self.scale, self.squared)
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
        super::cuda::adam_apply(s1, l1, (s2, l2), (s3, l3), self)
    }
}
