//! Differentiable building blocks: RMSNorm, rotary embeddings at arbitrary positions, SwiGLU,
//! dense and block-local attention with an additive mask, and linear layers. Each has a backward
//! pass (composed candle ops, or the fused ops and graph nodes of [`super::fused`]), so the
//! drafter trains through them; the finite-difference test in `drafter` checks it.

use candle_core::{DType, Device, Tensor};

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

pub use super::rope_cache::tables as rope_tables;

/// The rotary embedding in the Hugging Face ("neox", rotate-half) layout, differentiable
/// ([`super::fused::rope`]). `x`: `[heads, n, head_dim]`; `cos`, `sin`: `[n, head_dim / 2]`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    super::fused::rope(x, cos, sin)
}

/// `down(silu(gate(x)) * up(x))`, the gate one fused op with its own backward
/// ([`super::fused::swiglu`]).
pub fn swiglu(x: &Tensor, gate: &Linear, up: &Linear, down: &Linear) -> Result<Tensor> {
    down.forward(&super::fused::swiglu(&gate.forward(x)?, &up.forward(x)?)?)
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

/// What each block of a block attention sees: the first `seen[j]` rows of the context (the
/// positions before its anchor when training, all of it when decoding) and all of its own block,
/// never another block. The forms the attention reads (the additive mask of the composed path,
/// the counts on the device for flash attention) are built on first use and kept, so every
/// layer of a step shares one.
#[derive(Clone, Debug)]
pub struct BlockMask {
    seen: Vec<u32>,
    context: usize,
    block: usize,
    additive: std::sync::OnceLock<Tensor>,
    on_device: std::sync::OnceLock<Tensor>,
}

impl BlockMask {
    /// Blocks of `block` rows over `context` context rows; block j sees its first `seen[j]`.
    pub fn new(seen: Vec<u32>, context: usize, block: usize) -> Self {
        Self {
            seen,
            context,
            block,
            additive: std::sync::OnceLock::new(),
            on_device: std::sync::OnceLock::new(),
        }
    }

    /// Per block, the count of context rows it sees.
    pub fn seen(&self) -> &[u32] {
        &self.seen
    }

    /// Rows per block.
    pub fn block(&self) -> usize {
        self.block
    }

    /// Context rows.
    pub fn context(&self) -> usize {
        self.context
    }

    /// The mask as an additive `[blocks * block, context + block]` tensor (0 where a row sees,
    /// -inf where it does not), for the composed path; built once, on `device` in `dtype`.
    pub fn additive(&self, dtype: DType, device: &Device) -> Result<Tensor> {
        let kept = self.additive.get();
        if let Some(t) = kept.filter(|t| t.dtype() == dtype && t.device().same_device(device)) {
            return Ok(t.clone());
        }
        let (s, b) = (self.context, self.block);
        let m = self.seen.len() * b;
        let mut v = vec![f32::NEG_INFINITY; m * (s + b)];
        for (j, &seen) in self.seen.iter().enumerate() {
            for r in j * b..(j + 1) * b {
                let row = &mut v[r * (s + b)..(r + 1) * (s + b)];
                row[..seen as usize].fill(0.0);
                row[s..].fill(0.0);
            }
        }
        let t = Tensor::from_vec(v, (m, s + b), device)?.to_dtype(dtype)?;
        // Kept for the next layer; a caller in another dtype or on another device gets its own.
        let _ = self.additive.set(t.clone());
        Ok(t)
    }

    /// The counts as a `u32` tensor on `device` (what the flash kernels read); built once. A
    /// step calls it before it queues any work (`written.rs`): a copy from the host in the
    /// middle of the step may wait for the GPU to drain.
    pub(crate) fn seen_on(&self, device: &Device) -> Result<Tensor> {
        if let Some(t) = self
            .on_device
            .get()
            .filter(|t| t.device().same_device(device))
        {
            return Ok(t.clone());
        }
        let t = Tensor::new(self.seen.as_slice(), device)?;
        let _ = self.on_device.set(t.clone());
        Ok(t)
    }
}

/// The drafter's attention: every block of `block` query rows attends to the shared context
/// and to its own block only, so the keys are the context's and the block's own, never the
/// other blocks' (a dense `[m, s + m]` score matrix would be mostly masked: at 512 anchors of 16
/// over 3,072 tokens, 11,264 columns of which at most 3,088 are open). `q`: `[heads, m, d]`;
/// context `k`, `v`: `[kv_heads, s, d]`; block `k`, `v`: `[kv_heads, m, d]`; `mask`: what each
/// block sees. The scores of each row against context and own block share one softmax.
///
/// On a GPU in bf16 it is flash attention ([`super::fused::flash`]): no score is written, the
/// context tiles past a block's anchor are skipped, and the backward pass recomputes the
/// probabilities from each row's log-sum-exp. Elsewhere it is composed. Either way it is one graph
/// node ([`super::fused::attention_node`]) whose backward is written out, keeping only the
/// log-sum-exp or the probabilities: composed from candle ops, the backward of the score-sized
/// reshapes, concatenations and narrows cost more than the matmuls.
pub fn block_attention(
    q: &Tensor,
    (ck, cv): (&Tensor, &Tensor),
    (bk, bv): (&Tensor, &Tensor),
    block: usize,
    mask: &BlockMask,
) -> Result<Tensor> {
    let tracked = [q, ck, cv, bk, bv].iter().any(|t| t.track_op());
    // A decoding round on a GPU without flash attention (f32): one block that sees all of its
    // context is plain attention.
    if !tracked
        && q.device().is_cuda()
        && mask.seen.len() == 1
        && mask.seen[0] as usize == ck.dim(1)?
        && !flash_applies(q, ck, block)?
    {
        return single_block_attention(q, (ck, cv), (bk, bv));
    }
    let (out, saved) = block_attention_saving(q, (ck, cv), (bk, bv), block, mask)?;
    if !tracked {
        return Ok(out);
    }
    super::fused::attention_node(q, (ck, cv), (bk, bv), out, saved)
}

/// Whether [`block_attention`] runs flash attention for these queries and context keys.
fn flash_applies(q: &Tensor, ck: &Tensor, block: usize) -> Result<bool> {
    let (heads, _, d) = q.dims3()?;
    Ok(block == super::fused::flash::ROWS
        && super::fused::flash::supports(q.device(), q.dtype(), d, heads, ck.dim(0)?))
}

/// [`block_attention`] untracked: its output and what its backward pass needs
/// ([`super::fused::Saved::backward`]), for a step whose backward is written out.
pub(crate) fn block_attention_saving(
    q: &Tensor,
    (ck, cv): (&Tensor, &Tensor),
    (bk, bv): (&Tensor, &Tensor),
    block: usize,
    mask: &BlockMask,
) -> Result<(Tensor, super::fused::Saved)> {
    let geometry = BlockGeometry::of(q, ck, block)?;
    if mask.block != block
        || mask.context != geometry.s
        || mask.seen.len() != geometry.blocks
        || mask.seen.iter().any(|&n| n as usize > geometry.s)
    {
        candle_core::bail!(
            "block attention: a mask for {} blocks of {} over {} context rows, given {} blocks of {block} over {}",
            mask.seen.len(),
            mask.block,
            mask.context,
            geometry.blocks,
            geometry.s
        );
    }
    if flash_applies(q, ck, block)? {
        let seen = mask.seen_on(q.device())?;
        let plain: Vec<Tensor> = [q, ck, cv, bk, bv].iter().map(|t| t.detach()).collect();
        let operands = super::fused::flash::BlockOperands {
            q: &plain[0],
            ck: &plain[1],
            cv: &plain[2],
            bk: &plain[3],
            bv: &plain[4],
            seen: &seen,
        };
        let (out, lse) = super::fused::flash::block_forward(&operands)?;
        return Ok((out, super::fused::Saved::LogSumExp { lse, seen }));
    }
    // Contiguous operands: cuBLAS takes no other batched layout (candle's CPU matmul does).
    let plain = |t: &Tensor| t.detach().contiguous();
    let additive = mask.additive(q.dtype(), q.device())?;
    let (out, probs) = geometry.forward(
        &plain(q)?,
        (&plain(ck)?, &plain(cv)?),
        (&plain(bk)?, &plain(bv)?),
        &additive,
    )?;
    Ok((out, super::fused::Saved::Probs { probs, geometry }))
}

/// [`block_attention`] for one block that sees all of its context (a decoding round's): plain
/// attention over the context's keys and values, then the block's, nothing masked. The
/// general form regroups heads and blocks with 4- and 5-D strided copies, each a layout that
/// candle uploads before copying on a GPU; here the keys and values are two appends and the
/// attention two matmuls and one softmax. The same maths (`a_block_seeing_its_whole_context_is_plain_attention`).
pub fn single_block_attention(
    q: &Tensor,
    (ck, cv): (&Tensor, &Tensor),
    (bk, bv): (&Tensor, &Tensor),
) -> Result<Tensor> {
    let k = Tensor::cat(&[ck, bk], 1)?;
    let v = Tensor::cat(&[cv, bv], 1)?;
    let open = Tensor::zeros((q.dim(1)?, k.dim(1)?), q.dtype(), q.device())?;
    attention(&q.contiguous()?, &k, &v, &open)
}

/// [`block_attention`] over sequences packed one after another: `masks[i]` says sequence i's
/// context rows (consecutive in `ck` / `cv`, after sequence i-1's) and blocks (consecutive in
/// `q`, `bk`, `bv`). Training stacks a micro-batch's sequences this way so that every
/// projection, norm and MLP runs once for all of them; the attention still runs per sequence,
/// since no block sees another sequence's rows. One mask is [`block_attention`] itself.
pub fn packed_block_attention(
    q: &Tensor,
    (ck, cv): (&Tensor, &Tensor),
    (bk, bv): (&Tensor, &Tensor),
    block: usize,
    masks: &[BlockMask],
) -> Result<Tensor> {
    if let [mask] = masks {
        return block_attention(q, (ck, cv), (bk, bv), block, mask);
    }
    let (rows, context) = (q.dim(1)?, ck.dim(1)?);
    let want_rows: usize = masks.iter().map(|m| m.seen.len() * m.block).sum();
    let want_context: usize = masks.iter().map(|m| m.context).sum();
    if want_rows != rows || want_context != context {
        candle_core::bail!(
            "packed block attention: masks for {want_rows} block rows over {want_context} context rows, given {rows} over {context}"
        );
    }
    let (mut at_row, mut at_context) = (0, 0);
    let mut outs = Vec::with_capacity(masks.len());
    for mask in masks {
        let (m, s) = (mask.seen.len() * mask.block, mask.context);
        // The kernels read contiguous operands; the copies are one sequence's rows.
        let rows_of = |t: &Tensor| t.narrow(1, at_row, m)?.contiguous();
        let context_of = |t: &Tensor| t.narrow(1, at_context, s)?.contiguous();
        outs.push(block_attention(
            &rows_of(q)?,
            (&context_of(ck)?, &context_of(cv)?),
            (&rows_of(bk)?, &rows_of(bv)?),
            block,
            mask,
        )?);
        at_row += m;
        at_context += s;
    }
    Tensor::cat(&outs, 1)
}

/// Causal attention for the frozen target: `q` `[heads, n, d]` at positions `past..past + n`,
/// `k`, `v` `[kv_heads, past + n, d]`; row i sees keys `0..=past + i`. Flash attention on a GPU
/// in bf16 ([`super::fused::flash::causal`]), else [`attention`] under `mask` (built by the
/// caller once for all layers; `None` only where flash attention applies).
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    past: usize,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    match mask {
        Some(mask) => attention(q, k, v, mask),
        None => super::fused::flash::causal(q, k, v, past),
    }
}

/// The shapes of a block attention, and its passes as plain (untracked) tensor ops.
#[derive(Clone, Copy, Debug)]
pub struct BlockGeometry {
    heads: usize,
    kv_heads: usize,
    group: usize,
    m: usize,
    s: usize,
    d: usize,
    block: usize,
    blocks: usize,
    scale: f64,
}

impl BlockGeometry {
    fn of(q: &Tensor, ck: &Tensor, block: usize) -> Result<Self> {
        let (heads, m, d) = q.dims3()?;
        let (kv_heads, s) = (ck.dim(0)?, ck.dim(1)?);
        let blocks = m / block.max(1);
        if block == 0 || blocks * block != m {
            candle_core::bail!("block attention: {m} rows are not whole blocks of {block}");
        }
        Ok(Self {
            heads,
            kv_heads,
            group: heads / kv_heads,
            m,
            s,
            d,
            block,
            blocks,
            scale: 1.0 / (d as f64).sqrt(),
        })
    }

    /// `[heads, m, x]` rows to `[kv * blocks, group * B, x]`: each block's query rows together.
    fn per_block(&self, t: &Tensor) -> Result<Tensor> {
        let x = t.dim(2)?;
        t.reshape((self.kv_heads, self.group, self.blocks, self.block, x))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((self.kv_heads * self.blocks, self.group * self.block, x))
    }

    /// The inverse of [`Self::per_block`]: `[kv * blocks, group * B, x]` to `[heads, m, x]`.
    fn unblock(&self, t: &Tensor) -> Result<Tensor> {
        let x = t.dim(2)?;
        t.reshape((self.kv_heads, self.blocks, self.group, self.block, x))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((self.heads, self.m, x))
    }

    /// Keys or values `[kv, m, d]` as `[kv * blocks, B, d]`.
    fn block_rows(&self, t: &Tensor) -> Result<Tensor> {
        t.contiguous()?
            .reshape((self.kv_heads * self.blocks, self.block, self.d))
    }

    /// `[kv, group, m, s + B]` probabilities (or their gradients) split into the context part
    /// `[kv, group * m, s]` and the own-block part `[kv * blocks, group * B, B]`.
    fn split(&self, p: &Tensor) -> Result<(Tensor, Tensor)> {
        let (kv, g) = (self.kv_heads, self.group);
        let ctx = p
            .narrow(3, 0, self.s)?
            .contiguous()?
            .reshape((kv, g * self.m, self.s))?;
        let own = p
            .narrow(3, self.s, self.block)?
            .reshape((kv, g, self.blocks, self.block, self.block))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((kv * self.blocks, g * self.block, self.block))?;
        Ok((ctx, own))
    }

    /// The inverse of [`Self::split`].
    fn join(&self, ctx: &Tensor, own: &Tensor) -> Result<Tensor> {
        let (kv, g) = (self.kv_heads, self.group);
        let ctx = ctx.reshape((kv, g, self.m, self.s))?;
        let own = own
            .reshape((kv, self.blocks, g, self.block, self.block))?
            .transpose(1, 2)?
            .reshape((kv, g, self.m, self.block))?;
        Tensor::cat(&[&ctx, &own], 3)
    }

    /// The output `[heads, m, d]` and the probabilities `[kv, group, m, s + B]`.
    fn forward(
        &self,
        q: &Tensor,
        (ck, cv): (&Tensor, &Tensor),
        (bk, bv): (&Tensor, &Tensor),
        mask: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (kv, g) = (self.kv_heads, self.group);
        let qg = q.reshape((kv, g * self.m, self.d))?;
        let qb = self.per_block(q)?;
        let ctx_scores = qg.matmul(&ck.t()?)?;
        let own_scores = qb.matmul(&self.block_rows(bk)?.t()?)?;
        let scores = self.join(&ctx_scores, &own_scores)?;
        let probs = super::fused::masked_softmax(&scores, mask, self.scale)?;
        let (p_ctx, p_own) = self.split(&probs)?;
        let ctx_out = p_ctx
            .matmul(&cv.contiguous()?)?
            .reshape((self.heads, self.m, self.d))?;
        let own_out = self.unblock(&p_own.matmul(&self.block_rows(bv)?)?)?;
        Ok(((ctx_out + own_out)?, probs))
    }

    /// Gradients of q, the context's k and v and the blocks' k and v, from the output's.
    #[allow(clippy::similar_names)]
    pub(crate) fn backward(
        &self,
        q: &Tensor,
        (ck, cv): (&Tensor, &Tensor),
        (bk, bv): (&Tensor, &Tensor),
        probs: &Tensor,
        d_out: &Tensor,
    ) -> Result<[Tensor; 5]> {
        let (kv, g) = (self.kv_heads, self.group);
        let (p_ctx, p_own) = self.split(probs)?;
        let d_out = d_out.contiguous()?;
        let dog = d_out.reshape((kv, g * self.m, self.d))?;
        let dob = self.per_block(&d_out)?;
        let (kb, vb) = (self.block_rows(bk)?, self.block_rows(bv)?);
        let d_cv = p_ctx.t()?.matmul(&dog)?;
        let d_bv = p_own.t()?.matmul(&dob)?.reshape((kv, self.m, self.d))?;
        let dp = self.join(&dog.matmul(&cv.t()?)?, &dob.matmul(&vb.t()?)?)?;
        let ds = super::fused::softmax_grad(probs, &dp, self.scale)?;
        let (ds_ctx, ds_own) = self.split(&ds)?;
        let qg = q.reshape((kv, g * self.m, self.d))?;
        let qb = self.per_block(q)?;
        let dq = (ds_ctx.matmul(ck)?.reshape((self.heads, self.m, self.d))?
            + self.unblock(&ds_own.matmul(&kb)?)?)?;
        let d_ck = ds_ctx.t()?.matmul(&qg)?;
        let d_bk = ds_own.t()?.matmul(&qb)?.reshape((kv, self.m, self.d))?;
        Ok([dq, d_ck, d_cv, d_bk, d_bv])
    }
}

/// Inputs with at most this many rows take the weights-first product on the CPU: a hybrid
/// target's batched decoding step at Qwen3.5-27B's widths (`train_probe decode`, 2 cores) took
/// 0.59-0.66 s at 32 rows against 0.87-0.91 with `x @ W^T`, and 1.15-1.26 s against
/// 1.43-1.50 at 64 (it was 16).
const FEW_ROWS: usize = 64;

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
            // A few rows on the CPU (a decoding step): `W @ x^T` streams the weights once, where
            // `x @ W^T` has the matmul pack all of the transposed weights first. cuBLAS reads a
            // transposed operand as it is, and there the product's transpose back would cost a
            // strided copy per projection (15 us each on an H100 in a verification pass, more
            // than the matmul): one row needs none (its transpose is already contiguous).
            Self::Dense(w) => match x.dims() {
                // One row goes in as two: the gemm crate takes a one-column product on one
                // thread, two columns on all of them (a hybrid target's decoding step at
                // Qwen3.5-27B's widths, one sequence, 2 cores: 0.16-0.18 s against 0.24).
                [1, _] if !x.device().is_cuda() => {
                    let two = Tensor::cat(&[x, x], 0)?;
                    w.matmul(&two.t()?)?.narrow(1, 0, 1)?.t()?.contiguous()
                }
                [n, _] if *n == 1 || (*n <= FEW_ROWS && !x.device().is_cuda()) => {
                    w.matmul(&x.t()?)?.t()?.contiguous()
                }
                [_, _] => super::fused::linear(x, w),
                _ => x.broadcast_matmul(&w.t()?),
            },
            Self::Quantized(q) => candle_core::Module::forward(q, x),
        }
    }
}
