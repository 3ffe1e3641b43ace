//! Graph nodes computed untracked whose backward passes are written out: the drafter's block
//! attention (composed, or flash attention on a GPU) and its linear layers.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};

use super::super::ops::BlockGeometry;
use super::Result;

/// What a block attention's forward kept for its backward pass.
pub(crate) enum Saved {
    /// The composed path: the probabilities `[kv, group, m, s + B]`
    /// ([`BlockGeometry::backward`]).
    Probs {
        /// The probabilities.
        probs: Tensor,
        /// The shapes.
        geometry: BlockGeometry,
    },
    /// Flash attention: each row's log-sum-exp and what each block sees
    /// ([`super::flash::block_backward`]).
    LogSumExp {
        /// `[heads, m]`, f32.
        lse: Tensor,
        /// Per block of 16 rows, the context rows it sees (`u32`, on the device).
        seen: Tensor,
    },
}

impl Saved {
    /// The gradients of q, the context's k and v and the blocks' k and v (contiguous, untracked
    /// operands) from the output's, given the forward's output `out`.
    pub(crate) fn backward(
        &self,
        q: &Tensor,
        (ck, cv): (&Tensor, &Tensor),
        (bk, bv): (&Tensor, &Tensor),
        out: &Tensor,
        d_out: &Tensor,
    ) -> Result<[Tensor; 5]> {
        match self {
            Saved::Probs { probs, geometry } => {
                geometry.backward(q, (ck, cv), (bk, bv), probs, d_out)
            }
            Saved::LogSumExp { lse, seen } => {
                let operands = super::flash::BlockOperands {
                    q,
                    ck,
                    cv,
                    bk,
                    bv,
                    seen,
                };
                super::flash::block_backward(&operands, out, lse, d_out)
            }
        }
    }
}

/// The graph node of a block attention computed untracked ([`super::super::ops::block_attention`]):
/// its forward hands over `out` (copied: candle's ops own their results), its backward uses
/// what the forward `saved`. The context's and blocks' keys and values enter as one
/// `[kv, s + m, d]` tensor each.
pub(crate) fn attention_node(
    q: &Tensor,
    (ck, cv): (&Tensor, &Tensor),
    (bk, bv): (&Tensor, &Tensor),
    out: Tensor,
    saved: Saved,
) -> Result<Tensor> {
    let k = Tensor::cat(&[ck, bk], 1)?;
    let v = Tensor::cat(&[cv, bv], 1)?;
    let context = ck.dim(1)?;
    q.apply_op3(
        &k,
        &v,
        AttentionNode {
            out,
            saved,
            context,
        },
    )
}

struct AttentionNode {
    out: Tensor,
    saved: Saved,
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
        let (q, k, v) = (q.detach().contiguous()?, k.detach(), v.detach());
        // Contiguous parts: cuBLAS and the kernels take no other layout.
        let part = |t: &Tensor, at: usize, n: usize| t.narrow(1, at, n)?.contiguous();
        let (ck, cv, bk, bv) = (
            part(&k, 0, s)?,
            part(&v, 0, s)?,
            part(&k, s, m)?,
            part(&v, s, m)?,
        );
        let [dq, d_ck, d_cv, d_bk, d_bv] =
            self.saved
                .backward(&q, (&ck, &cv), (&bk, &bv), &self.out, d_out)?;
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
pub(super) fn handed_over<S: BackendStorage>(
    t: &Tensor,
    pick: impl Fn(&candle_core::Storage) -> Option<&S>,
) -> Result<(S, Shape)> {
    let (storage, layout) = t.storage_and_layout();
    let s = pick(&storage).ok_or_else(|| {
        candle_core::Error::Msg("a graph node's output is on another device".into())
    })?;
    Ok((s.try_clone(layout)?, layout.shape().clone()))
}

pub(super) fn on_cpu(s: &candle_core::Storage) -> Option<&CpuStorage> {
    match s {
        candle_core::Storage::Cpu(c) => Some(c),
        _ => None,
    }
}

#[cfg(feature = "cuda")]
pub(super) fn on_cuda(s: &candle_core::Storage) -> Option<&candle_core::CudaStorage> {
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
        // Only the operands on a path to a variable get a gradient: the frozen LM head is one of
        // these layers, and its [vocab, H] gradient would cost as much as the step's logits.
        let dx = x.track_op().then(|| dy.matmul(&w.detach())).transpose()?;
        let dw = w
            .track_op()
            .then(|| dy.t()?.matmul(&x.detach()))
            .transpose()?;
        Ok((dx, dw))
    }
}
