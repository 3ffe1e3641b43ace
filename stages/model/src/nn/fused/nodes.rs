//! Graph nodes computed untracked whose backward passes are written out: the drafter's block
//! attention (composed, or flash attention on a GPU) and its linear layers.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};

use super::super::ops::BlockGeometry;
use super::Result;

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
        },
    )
}

struct AttentionNode {
    out: Tensor,
    probs: Tensor,
    geometry: BlockGeometry,
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
        let (s, m) = self.geometry.rows();
        let (q, k, v) = (q.detach().contiguous()?, k.detach(), v.detach());
        // Contiguous parts: cuBLAS takes no other batched layout.
        let part = |t: &Tensor, at: usize, n: usize| t.narrow(1, at, n)?.contiguous();
        let [dq, d_ck, d_cv, d_bk, d_bv] = self.geometry.backward(
            &q,
            (&part(&k, 0, s)?, &part(&v, 0, s)?),
            (&part(&k, s, m)?, &part(&v, s, m)?),
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

/// The graph node of a block attention computed by the flash kernels
/// ([`super::flash::block_forward`]): its forward hands over `out`, its backward is
/// [`super::flash::block_backward`] with the kept log-sum-exp. As in [`attention_node`], the
/// context's and blocks' keys and values enter as one `[kv, s + m, d]` tensor each.
pub(crate) fn flash_attention_node(
    q: &Tensor,
    (ck, cv): (&Tensor, &Tensor),
    (bk, bv): (&Tensor, &Tensor),
    out: Tensor,
    lse: Tensor,
    seen: Tensor,
) -> Result<Tensor> {
    let k = Tensor::cat(&[ck, bk], 1)?;
    let v = Tensor::cat(&[cv, bv], 1)?;
    q.apply_op3(
        &k,
        &v,
        FlashAttentionNode {
            out,
            lse,
            seen,
            context: ck.dim(1)?,
        },
    )
}

struct FlashAttentionNode {
    out: Tensor,
    lse: Tensor,
    seen: Tensor,
    context: usize,
}

impl CustomOp3 for FlashAttentionNode {
    fn name(&self) -> &'static str {
        "flash-block-attention"
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
        let (k, v) = (k.detach(), v.detach());
        let part = |t: &Tensor, at: usize, n: usize| t.narrow(1, at, n)?.contiguous();
        let (ck, bk, cv, bv) = (
            part(&k, 0, s)?,
            part(&k, s, m)?,
            part(&v, 0, s)?,
            part(&v, s, m)?,
        );
        let q = q.detach();
        let operands = super::flash::BlockOperands {
            q: &q,
            ck: &ck,
            cv: &cv,
            bk: &bk,
            bv: &bv,
            seen: &self.seen,
        };
        let [dq, d_ck, d_cv, d_bk, d_bv] =
            super::flash::block_backward(&operands, &self.out, &self.lse, d_out)?;
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
