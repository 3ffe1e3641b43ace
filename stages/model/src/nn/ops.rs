//! Differentiable building blocks: RMSNorm, rotary embeddings at arbitrary positions, SwiGLU,
//! and attention with an additive mask. Each has a backward pass (composed candle ops, or the
//! fused softmax of [`super::fused`]), so the drafter trains through them; the
//! finite-difference test in `drafter` checks it.

use candle_core::{D, DType, Device, Tensor};

use super::Result;

/// The dtype reductions run in: f32 for half types, else the dtype itself.
pub fn wide(dtype: DType) -> DType {
    match dtype {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    }
}

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension: one fused op with its own
/// backward ([`super::fused::rms_norm`]).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    super::fused::rms_norm(x, weight, eps)
}

/// Cos and sin tables of the rotary embedding for each position: `[n, head_dim / 2]` each.
pub fn rope_tables(
    positions: &[u32],
    head_dim: usize,
    theta: f64,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let half = head_dim / 2;
    let mut cos = Vec::with_capacity(positions.len() * half);
    let mut sin = Vec::with_capacity(positions.len() * half);
    for &p in positions {
        for i in 0..half {
            let freq = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
            let angle = f64::from(p) * freq;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    let n = positions.len();
    Ok((
        Tensor::from_vec(cos, (n, half), device)?.to_dtype(dtype)?,
        Tensor::from_vec(sin, (n, half), device)?.to_dtype(dtype)?,
    ))
}

/// The rotary embedding in the Hugging Face ("neox", rotate-half) layout, differentiable
/// ([`super::fused::rope`]). `x`: `[heads, n, head_dim]`; `cos`, `sin`: `[n, head_dim / 2]`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    super::fused::rope(x, cos, sin)
}

/// `down(silu(gate(x)) * up(x))`.
pub fn swiglu(x: &Tensor, gate: &Linear, up: &Linear, down: &Linear) -> Result<Tensor> {
    let g = gate.forward(x)?.silu()?;
    down.forward(&(g * up.forward(x)?)?)
}

/// Softmax attention. `q`: `[heads, nq, d]`, `k`, `v`: `[kv_heads, nk, d]`, `mask`: additive
/// `[nq, nk]` (0 or -inf). Grouped-query heads share their K/V head. Differentiable: the scale,
/// mask and softmax are one fused op with its own backward ([`super::fused::masked_softmax`]),
/// the same for the frozen target and the drafter, on every device.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let (heads, nq, d) = q.dims3()?;
    let (kv_heads, nk) = (k.dim(0)?, k.dim(1)?);
    let group = heads / kv_heads;
    // [kv, group * nq, d]: each K/V head serves its group of query heads in one matmul.
    let q = q.reshape((kv_heads, group * nq, d))?;
    let scores = q.matmul(&k.t()?)?.reshape((kv_heads, group, nq, nk))?;
    let probs = super::fused::masked_softmax(&scores, mask, 1.0 / (d as f64).sqrt())?.reshape((
        kv_heads,
        group * nq,
        nk,
    ))?;
    probs.matmul(&v.contiguous()?)?.reshape((heads, nq, d))
}

/// The drafter's attention: every block of `block` query rows attends to the shared context
/// and to its own block only, so the keys are the context's and the block's own, never the
/// other blocks' (a dense `[m, s + m]` score matrix would be mostly masked: at 512 anchors of 16
/// over 3,072 tokens, 11,264 columns of which at most 3,088 are open). `q`: `[heads, m, d]`;
/// context `k`, `v`: `[kv_heads, s, d]`; block `k`, `v`: `[kv_heads, m, d]`; `mask`: additive
/// `[m, s + block]`. The scores of each row against context and own block share one softmax.
pub fn block_attention(
    q: &Tensor,
    (ck, cv): (&Tensor, &Tensor),
    (bk, bv): (&Tensor, &Tensor),
    block: usize,
    mask: &Tensor,
) -> Result<Tensor> {
    let (heads, m, d) = q.dims3()?;
    let (kv_heads, s) = (ck.dim(0)?, ck.dim(1)?);
    let (group, blocks) = (heads / kv_heads, m / block);
    if blocks * block != m {
        candle_core::bail!("block attention: {m} rows are not whole blocks of {block}");
    }
    let scale = 1.0 / (d as f64).sqrt();
    // Against the context: [kv, group * m, s].
    let qg = q.reshape((kv_heads, group * m, d))?;
    let ctx_scores = qg.matmul(&ck.t()?)?.reshape((kv_heads, group, m, s))?;
    // Within each block: queries [kv * blocks, group * B, d] against keys [kv * blocks, B, d].
    let qb = q
        .reshape((kv_heads, group, blocks, block, d))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((kv_heads * blocks, group * block, d))?;
    let kb = bk.reshape((kv_heads * blocks, block, d))?;
    let own_scores = qb
        .matmul(&kb.t()?)?
        .reshape((kv_heads, blocks, group, block, block))?
        .transpose(1, 2)?
        .reshape((kv_heads, group, m, block))?;
    let scores = Tensor::cat(&[&ctx_scores, &own_scores], 3)?;
    let probs = super::fused::masked_softmax(&scores, mask, scale)?;
    let ctx_out = probs
        .narrow(3, 0, s)?
        .reshape((kv_heads, group * m, s))?
        .matmul(&cv.contiguous()?)?;
    let own_out = probs
        .narrow(3, s, block)?
        .reshape((kv_heads, group, blocks, block, block))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((kv_heads * blocks, group * block, block))?
        .matmul(&bv.contiguous()?.reshape((kv_heads * blocks, block, d))?)?
        .reshape((kv_heads, blocks, group, block, d))?
        .transpose(1, 2)?
        .reshape((kv_heads, group * m, d))?;
    (ctx_out + own_out)?.reshape((heads, m, d))
}

/// Softmax over the last dimension from differentiable ops.
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// `log(softmax(x))` over the last dimension from differentiable ops.
pub fn log_softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    shifted.broadcast_sub(&shifted.exp()?.sum_keepdim(D::Minus1)?.log()?)
}

/// Inputs with at most this many rows take the weights-first product.
const FEW_ROWS: usize = 16;

/// A bias-free linear layer: dense weights (trainable or frozen) or quantized (frozen).
#[derive(Clone, Debug)]
pub enum Linear {
    /// `[out, in]`.
    Dense(Tensor),
    /// A GGUF tensor, multiplied without dequantizing it whole.
    Quantized(candle_core::quantized::QMatMul),
}

impl Linear {
    /// `x @ W^T` over the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            // A few rows (a decoding step): `W @ x^T` streams the weights once, where `x @ W^T`
            // has the matmul pack all of the transposed weights first.
            Self::Dense(w) => match x.dims() {
                [n, _] if *n <= FEW_ROWS => w.matmul(&x.t()?)?.t()?.contiguous(),
                [_, _] => x.matmul(&w.t()?),
                _ => x.broadcast_matmul(&w.t()?),
            },
            Self::Quantized(q) => candle_core::Module::forward(q, x),
        }
    }
}
