//! The DFlash drafter's training step with its backward pass written out: the loss, the
//! metrics and every weight's gradient of [`super::objective::loss_packed`], with no autograd
//! graph.
//!
//! Through candle's autograd every gradient that reaches a tensor is added into a fresh zeroed
//! buffer of its size (`GradStore::or_insert` then `add`: a fill and an add per edge, also where
//! a tensor has one consumer, which in a transformer is nearly every one), each cast between
//! the f32 master weights and the bf16 step is a node with its own pair, and every node keeps
//! its inputs alive until the backward pass reaches it. At the Qwen3-8B shape (8,192 block rows,
//! MLP width 12,288) that is gigabytes of memory traffic a layer. Here the forward keeps what
//! the backward reads (per layer: its input, the normed rows, the pre-norm projections, the
//! attention's operands and output, the MLP's gate and up rows) and the backward walks the
//! layers in reverse with the same fused kernels the graph nodes call: each gradient is
//! written once. The weights come in the compute dtype, cast once and then kept by the
//! optimizer ([`ComputeWeights`]), and their gradients leave in it: on a GPU AdamW reads the
//! bf16 gradients and updates the f32 master weights and the kept copy in one pass.
//!
//! DFlash drafters only (DFlash 2's convolutions and selector keep the autograd path); `train`
//! takes this path on a GPU ([`Backward::on`]); CPU training keeps autograd, bit for bit. The
//! tests hold it to autograd in f64: loss, metrics and every gradient.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};

use super::Result;
use super::drafter::Drafter;
use super::fused::{
    self, Saved, head_cross_entropy_rows, linear, rms_norm, rms_norm_backward, rope, rope_backward,
    swiglu, swiglu_backward,
};
use super::objective::{Batch, Packed, StepMetrics};
use super::ops::{self, BlockMask};

/// How a training step gets its gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backward {
    /// candle's autograd over the graph the forward records.
    Autograd,
    /// This module's backward pass, written out.
    WrittenOut,
}

impl Backward {
    /// Written out on a GPU for a DFlash drafter; autograd elsewhere (CPU training stays what it
    /// was, bit for bit; DFlash 2's extra layers have no written-out backward).
    pub fn on(device: &candle_core::Device, drafter: &Drafter) -> Self {
        if device.is_cuda() && drafter.config.dflash2.is_none() {
            Self::WrittenOut
        } else {
            Self::Autograd
        }
    }
}

/// A drafter's weights in a step's compute dtype (bf16 on a GPU), untracked, by name: what the
/// written-out step multiplies with. Made once by a cast ([`Self::of`]); a training loop keeps
/// them across steps and the optimizer keeps them the updated weights' casts
/// ([`super::AdamW::step_keeping`]), so no step casts its f32 master weights again.
pub struct ComputeWeights(BTreeMap<String, Tensor>);

impl ComputeWeights {
    /// Each weight cast to `dtype` (each its own buffer: the optimizer writes them in place).
    pub fn of(drafter: &Drafter, dtype: DType) -> Result<Self> {
        let cast = drafter.vars.keys().map(|name| {
            let w = drafter.w(name).detach().to_dtype(dtype)?.copy()?;
            Ok((name.clone(), w))
        });
        Ok(Self(cast.collect::<Result<_>>()?))
    }

    /// By name.
    pub fn tensors(&self) -> &BTreeMap<String, Tensor> {
        &self.0
    }

    /// Their dtype (none: no weights).
    fn dtype(&self) -> Option<DType> {
        self.0.values().next().map(Tensor::dtype)
    }

    fn get(&self, name: &str) -> Result<Tensor> {
        self.0
            .get(name)
            .cloned()
            .ok_or_else(|| candle_core::Error::Msg(format!("the drafter has no {name}")))
    }
}

/// Rows `[n, heads * d]` as heads `[heads, n, d]`, contiguous.
fn heads_of(x: &Tensor, heads: usize, d: usize) -> Result<Tensor> {
    fused::contiguous3(&x.reshape((x.dim(0)?, heads, d))?.transpose(0, 1)?)
}

/// Heads `[heads, n, d]` as rows `[n, heads * d]`, contiguous.
fn rows_of(x: &Tensor) -> Result<Tensor> {
    let (heads, n, d) = x.dims3()?;
    fused::contiguous3(&x.transpose(0, 1)?)?.reshape((n, heads * d))
}

/// `dy^T @ x`: a linear layer's weight gradient `[out, in]` from its output's `[n, out]` and
/// its input `[n, in]`.
fn weight_grad(dy: &Tensor, x: &Tensor) -> Result<Tensor> {
    dy.t()?.matmul(x)
}

/// A projection's normed, rotated heads and what their backward needs.
struct Projected {
    /// The projection `[n, heads * d]` before the per-head norm.
    raw: Tensor,
    /// The normed, rotated heads `[heads, n, d]`.
    heads: Tensor,
}

/// What one layer's forward keeps for its backward (`m` block rows, `s` context rows).
struct LayerSaved {
    /// The layer's input `[m, H]` and its input norm's output.
    x: Tensor,
    h1: Tensor,
    /// The queries, the blocks' keys and values `[kv, m, d]`, the context's keys and values
    /// `[kv, s, d]`.
    q: Projected,
    kb: Projected,
    vb: Tensor,
    kc: Projected,
    vc: Tensor,
    /// The attention's output `[heads, m, d]` and, per packed sequence, what its backward needs.
    out: Tensor,
    saved: Vec<Saved>,
    /// The attention's output as rows `[m, heads * d]` (the o projection's input).
    a: Tensor,
    /// The residual after attention and its norm's output (the MLP's input).
    x1: Tensor,
    h2: Tensor,
    /// The MLP's gate and up rows `[m, ffn]` (SwiGLU's product is recomputed from them).
    g: Tensor,
    u: Tensor,
}

/// The loss, the metrics and the gradient of every trainable tensor (by name, in the step's
/// compute dtype, the context's: the optimizer reads them as they are) of
/// [`super::objective::loss_packed`] for a DFlash drafter, computed without a graph (module
/// docs). `weights`: the drafter's weights in that dtype, if kept across steps (else cast
/// here). The LM head runs in chunks of rows ([`fused::head_cross_entropy_rows`]).
pub fn loss_and_gradients(
    drafter: &Drafter,
    weights: Option<&ComputeWeights>,
    embed: &dyn Fn(&Tensor) -> Result<Tensor>,
    lm_head: &Tensor,
    context: &Tensor,
    batches: &[&Batch],
    normalizer: f64,
) -> Result<(f64, StepMetrics, BTreeMap<String, Tensor>)> {
    let c = &drafter.config;
    if c.dflash2.is_some() {
        candle_core::bail!("the written-out backward covers DFlash drafters, not DFlash 2");
    }
    let device = context.device();
    let dtype = context.dtype();
    let p = Packed::of(batches)?;
    let (bs, blocks) = (p.bs, p.blocks);
    let context = context.detach();
    let cast;
    let w = match weights {
        Some(w) if w.dtype() == Some(dtype) => w,
        Some(w) => candle_core::bail!(
            "the kept weights are {:?}, the step computes in {dtype:?}",
            w.dtype()
        ),
        None => {
            cast = ComputeWeights::of(drafter, dtype)?;
            &cast
        }
    };
    let (hd, heads, kv) = (c.head_dim, c.heads, c.kv_heads);

    // What the step reads from the host goes to the device first, before any of the step's
    // work is queued: a copy from the host between kernels may wait for the GPU to drain.
    let (cos_c, sin_c) = ops::rope_tables(&p.context_pos, hd, c.rope_theta, dtype, device)?;
    let (cos_b, sin_b) = ops::rope_tables(&p.block_pos, hd, c.rope_theta, dtype, device)?;
    let ids = Tensor::new(p.block_ids.as_slice(), device)?;
    let row_weights = Tensor::new(p.weights.as_slice(), device)?;
    if device.is_cuda() {
        for mask in &p.masks {
            mask.seen_on(device)?;
        }
    }

    // The context: the tapped layers fused, normed; every layer projects it to keys and values.
    let fc = w.get("fc.weight")?;
    let c0 = linear(&context, &fc)?;
    let hidden_norm = w.get("hidden_norm.weight")?;
    let ctx = rms_norm(&c0, &hidden_norm, c.eps)?;
    let project = |x: &Tensor,
                   weight: &Tensor,
                   norm: &Tensor,
                   n_heads: usize,
                   (cos, sin): (&Tensor, &Tensor)|
     -> Result<Projected> {
        let raw = linear(x, weight)?;
        let normed = rms_norm(&raw.reshape((raw.dim(0)?, n_heads, hd))?, norm, c.eps)?;
        let heads = rope(&fused::contiguous3(&normed.transpose(0, 1)?)?, cos, sin)?;
        Ok(Projected { raw, heads })
    };

    let mut x = embed(&ids)?.to_dtype(dtype)?.detach();
    let m = x.dim(0)?;
    let mut layers = Vec::with_capacity(c.layers);
    for i in 0..c.layers {
        let name = |n: &str| format!("layers.{i}.{n}");
        let h1 = rms_norm(&x, &w.get(&name("input_layernorm.weight"))?, c.eps)?;
        let (wq, wk, wv) = (
            w.get(&name("self_attn.q_proj.weight"))?,
            w.get(&name("self_attn.k_proj.weight"))?,
            w.get(&name("self_attn.v_proj.weight"))?,
        );
        let (q_norm, k_norm) = (
            w.get(&name("self_attn.q_norm.weight"))?,
            w.get(&name("self_attn.k_norm.weight"))?,
        );
        let q = project(&h1, &wq, &q_norm, heads, (&cos_b, &sin_b))?;
        let kb = project(&h1, &wk, &k_norm, kv, (&cos_b, &sin_b))?;
        let vb = heads_of(&linear(&h1, &wv)?, kv, hd)?;
        let kc = project(&ctx, &wk, &k_norm, kv, (&cos_c, &sin_c))?;
        let vc = heads_of(&linear(&ctx, &wv)?, kv, hd)?;
        let (out, saved) = attend(&q.heads, (&kc.heads, &vc), (&kb.heads, &vb), bs, &p.masks)?;
        let a = rows_of(&out)?;
        let x1 = fused::add(&x, &linear(&a, &w.get(&name("self_attn.o_proj.weight"))?)?)?;
        let h2 = rms_norm(
            &x1,
            &w.get(&name("post_attention_layernorm.weight"))?,
            c.eps,
        )?;
        let g = linear(&h2, &w.get(&name("mlp.gate_proj.weight"))?)?;
        let u = linear(&h2, &w.get(&name("mlp.up_proj.weight"))?)?;
        let down = linear(&swiglu(&g, &u)?, &w.get(&name("mlp.down_proj.weight"))?)?;
        let x2 = fused::add(&x1, &down)?;
        layers.push(LayerSaved {
            x,
            h1,
            q,
            kb,
            vb,
            kc,
            vc,
            out,
            saved,
            a,
            x1,
            h2,
            g,
            u,
        });
        x = x2;
    }
    let final_norm = w.get("norm.weight")?;
    let hidden = rms_norm(&x, &final_norm, c.eps)?;
    // Rows k >= 1 of every block predict (row 0, the anchor, does not): a narrow of each block.
    let h = c.hidden;
    let rows = hidden
        .reshape((blocks, bs, h))?
        .narrow(1, 1, bs - 1)?
        .contiguous()?
        .reshape((blocks * (bs - 1), h))?;
    let (head, d_rows) = head_cross_entropy_rows(&rows, lm_head, &p.labels, 1)?;
    let wide = head.nll.dtype();
    let weights = row_weights.to_dtype(wide)?;
    // The loss and the predictions are read back after the backward is queued: reading them
    // here would wait for the GPU to drain between the forward and the backward.
    let loss = (head.nll.mul(&weights)?.sum_all()? / normalizer)?.to_dtype(DType::F64)?;
    // d loss / d nll per row.
    let scale = (weights / normalizer)?;

    // Backward. Gradients are in the activations' dtype until they meet their weight.
    let mut grads: BTreeMap<String, Tensor> = BTreeMap::new();
    let mut give = |name: String, g: Tensor| -> Result<()> {
        let g = match grads.remove(&name) {
            Some(prev) => fused::add(&prev, &g)?,
            None => g,
        };
        grads.insert(name, g);
        Ok(())
    };
    let d_rows = d_rows
        .to_dtype(wide)?
        .broadcast_mul(&scale.unsqueeze(1)?)?
        .to_dtype(dtype)?;
    // The anchors' rows get none.
    let d_hidden = Tensor::cat(
        &[
            &Tensor::zeros((blocks, 1, h), dtype, device)?,
            &d_rows.reshape((blocks, bs - 1, h))?,
        ],
        1,
    )?
    .reshape((m, h))?;
    let (mut dx, dw) = rms_norm_backward(&x, &final_norm, &d_hidden, c.eps)?;
    give("norm.weight".into(), dw)?;
    let mut d_ctx: Option<Tensor> = None;
    for (i, s) in layers.iter().enumerate().rev() {
        let name = |n: &str| format!("layers.{i}.{n}");
        // The MLP: x2 = x1 + down(swiglu(gate(h2), up(h2))).
        let wd = w.get(&name("mlp.down_proj.weight"))?;
        give(
            name("mlp.down_proj.weight"),
            weight_grad(&dx, &swiglu(&s.g, &s.u)?)?,
        )?;
        let (dg, du) = swiglu_backward(&s.g, &s.u, &dx.matmul(&wd)?)?;
        let (wg, wu) = (
            w.get(&name("mlp.gate_proj.weight"))?,
            w.get(&name("mlp.up_proj.weight"))?,
        );
        give(name("mlp.gate_proj.weight"), weight_grad(&dg, &s.h2)?)?;
        give(name("mlp.up_proj.weight"), weight_grad(&du, &s.h2)?)?;
        let dh2 = fused::add(&dg.matmul(&wg)?, &du.matmul(&wu)?)?;
        let post = name("post_attention_layernorm.weight");
        let (dx1, dw) = rms_norm_backward(&s.x1, &w.get(&post)?, &dh2, c.eps)?;
        give(post, dw)?;
        let dx1 = fused::add(&dx, &dx1)?;
        // Attention: x1 = x + o(attend(q, k, v)).
        let wo = w.get(&name("self_attn.o_proj.weight"))?;
        give(name("self_attn.o_proj.weight"), weight_grad(&dx1, &s.a)?)?;
        let d_out = heads_of(&dx1.matmul(&wo)?, heads, hd)?;
        let [dq, dkc, dvc, dkb, dvb] = attend_backward(s, &d_out, &p.masks)?;
        let (wq, wk, wv) = (
            w.get(&name("self_attn.q_proj.weight"))?,
            w.get(&name("self_attn.k_proj.weight"))?,
            w.get(&name("self_attn.v_proj.weight"))?,
        );
        let (q_norm, k_norm) = (
            name("self_attn.q_norm.weight"),
            name("self_attn.k_norm.weight"),
        );
        // A projection's input gradient and its weight's, through rope and the per-head norm.
        let unproject = |d: &Tensor,
                         pr: &Projected,
                         norm: &Tensor,
                         (cos, sin): (&Tensor, &Tensor)|
         -> Result<(Tensor, Tensor)> {
            let (n, width) = pr.raw.dims2()?;
            let n_heads = width / hd;
            let d = rows_of(&rope_backward(d, cos, sin)?)?.reshape((n, n_heads, hd))?;
            let (d_raw, d_norm) =
                rms_norm_backward(&pr.raw.reshape((n, n_heads, hd))?, norm, &d, c.eps)?;
            Ok((d_raw.reshape((n, width))?, d_norm))
        };
        let (qn, kn) = (w.get(&q_norm)?, w.get(&k_norm)?);
        let (dq_raw, dqn) = unproject(&dq, &s.q, &qn, (&cos_b, &sin_b))?;
        let (dkb_raw, dkn_b) = unproject(&dkb, &s.kb, &kn, (&cos_b, &sin_b))?;
        let (dkc_raw, dkn_c) = unproject(&dkc, &s.kc, &kn, (&cos_c, &sin_c))?;
        give(q_norm, dqn)?;
        give(k_norm, fused::add(&dkn_b, &dkn_c)?)?;
        let (dvb, dvc) = (rows_of(&dvb)?, rows_of(&dvc)?);
        give(
            name("self_attn.q_proj.weight"),
            weight_grad(&dq_raw, &s.h1)?,
        )?;
        give(
            name("self_attn.k_proj.weight"),
            fused::add(
                &weight_grad(&dkb_raw, &s.h1)?,
                &weight_grad(&dkc_raw, &ctx)?,
            )?,
        )?;
        give(
            name("self_attn.v_proj.weight"),
            fused::add(&weight_grad(&dvb, &s.h1)?, &weight_grad(&dvc, &ctx)?)?,
        )?;
        let dh1 = fused::add(
            &fused::add(&dq_raw.matmul(&wq)?, &dkb_raw.matmul(&wk)?)?,
            &dvb.matmul(&wv)?,
        )?;
        let dc = fused::add(&dkc_raw.matmul(&wk)?, &dvc.matmul(&wv)?)?;
        d_ctx = Some(match d_ctx {
            Some(prev) => fused::add(&prev, &dc)?,
            None => dc,
        });
        let pre = name("input_layernorm.weight");
        let (dxn, dw) = rms_norm_backward(&s.x, &w.get(&pre)?, &dh1, c.eps)?;
        give(pre, dw)?;
        dx = fused::add(&dx1, &dxn)?;
    }
    // The context's fusion: ctx = hidden_norm(fc(context)); the target's taps get no gradient.
    if let Some(d_ctx) = d_ctx {
        let (dc0, dw) = rms_norm_backward(&c0, &hidden_norm, &d_ctx, c.eps)?;
        give("hidden_norm.weight".into(), dw)?;
        give("fc.weight".into(), weight_grad(&dc0, &context)?)?;
    }
    let loss = loss.to_scalar::<f64>()?;
    let predicted: Vec<u32> = head.top.flatten_all()?.to_vec1()?;
    let metrics = StepMetrics::of_rows(loss, &predicted, &p.labels, &p.weights, bs, blocks);
    Ok((loss, metrics, grads))
}

/// The block attention of packed sequences ([`ops::packed_block_attention`]), untracked: the
/// output `[heads, m, d]` and, per sequence, what its backward needs.
fn attend(
    q: &Tensor,
    (ck, cv): (&Tensor, &Tensor),
    (bk, bv): (&Tensor, &Tensor),
    block: usize,
    masks: &[BlockMask],
) -> Result<(Tensor, Vec<Saved>)> {
    if let [mask] = masks {
        let (out, saved) = ops::block_attention_saving(q, (ck, cv), (bk, bv), block, mask)?;
        return Ok((out, vec![saved]));
    }
    let (mut outs, mut saved) = (Vec::new(), Vec::new());
    for (rows, context, mask) in spans(masks) {
        let r = |t: &Tensor| t.narrow(1, rows.0, rows.1)?.contiguous();
        let s = |t: &Tensor| t.narrow(1, context.0, context.1)?.contiguous();
        let (out, sv) = ops::block_attention_saving(
            &r(q)?,
            (&s(ck)?, &s(cv)?),
            (&r(bk)?, &r(bv)?),
            block,
            mask,
        )?;
        outs.push(out);
        saved.push(sv);
    }
    Ok((Tensor::cat(&outs, 1)?, saved))
}

/// Per packed sequence: its block rows and context rows (start, count) and its mask.
fn spans(masks: &[BlockMask]) -> Vec<((usize, usize), (usize, usize), &BlockMask)> {
    let (mut at_row, mut at_context) = (0, 0);
    masks
        .iter()
        .map(|mask| {
            let (m, s) = (mask.seen().len() * mask.block(), mask.context());
            let span = ((at_row, m), (at_context, s), mask);
            at_row += m;
            at_context += s;
            span
        })
        .collect()
}

/// [`attend`]'s gradients in q, the context's k and v and the blocks' k and v.
fn attend_backward(s: &LayerSaved, d_out: &Tensor, masks: &[BlockMask]) -> Result<[Tensor; 5]> {
    let (q, kc, kb) = (&s.q.heads, &s.kc.heads, &s.kb.heads);
    if let [saved] = s.saved.as_slice() {
        return saved.backward(q, (kc, &s.vc), (kb, &s.vb), &s.out, d_out);
    }
    let mut parts: [Vec<Tensor>; 5] = Default::default();
    for ((rows, context, _), saved) in spans(masks).into_iter().zip(&s.saved) {
        let r = |t: &Tensor| t.narrow(1, rows.0, rows.1)?.contiguous();
        let c = |t: &Tensor| t.narrow(1, context.0, context.1)?.contiguous();
        let grads = saved.backward(
            &r(q)?,
            (&c(kc)?, &c(&s.vc)?),
            (&r(kb)?, &r(&s.vb)?),
            &r(&s.out)?,
            &r(d_out)?,
        )?;
        for (part, g) in parts.iter_mut().zip(grads) {
            part.push(g);
        }
    }
    let cat = |v: &[Tensor]| Tensor::cat(v, 1);
    Ok([
        cat(&parts[0])?,
        cat(&parts[1])?,
        cat(&parts[2])?,
        cat(&parts[3])?,
        cat(&parts[4])?,
    ])
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::loss_and_gradients;
    use crate::nn::drafter::{Drafter, DrafterConfig};
    use crate::nn::objective::{Batch, Head, loss_packed};

    /// The written-out backward gives autograd's loss, metrics and every gradient (f64, so any
    /// difference past rounding is a wrong formula), for one sequence and for three packed.
    #[test]
    fn the_written_out_backward_is_autograd() {
        let dtype = DType::F64;
        let target = crate::nn::drafter::tests::tiny_target(dtype);
        let config = DrafterConfig::for_target(&target.config, 2, vec![0, 2], 4, 39);
        let drafter = Drafter::init(config, 3, dtype, &Device::Cpu).unwrap();
        // Norm weights off 1, so a norm's weight in a formula shows.
        crate::nn::drafter::tests::perturb(&drafter, "norm");
        let taps = drafter.config.target_layers.clone();
        let (seqs, batches) = crate::nn::drafter::tests::three_sequences();
        let embed = |t: &Tensor| target.embed(t);
        for count in [1, 3] {
            let refs: Vec<&Batch> = batches[..count].iter().collect();
            let contexts: Vec<Tensor> = seqs[..count]
                .iter()
                .map(|(ids, _)| target.tapped(ids, &taps).unwrap())
                .collect();
            let context = Tensor::cat(&contexts, 0).unwrap();
            let norm: f64 = refs.iter().map(|b| b.weight()).sum::<f64>() * 1.5;
            let (l, m) = loss_packed(
                &drafter,
                &embed,
                &target.lm_head,
                &context,
                &refs,
                norm,
                Head::Chunked,
            )
            .unwrap();
            let autograd = drafter.gradients(&l.backward().unwrap());
            let (loss, wm, written) = loss_and_gradients(
                &drafter,
                None,
                &embed,
                &target.lm_head,
                &context,
                &refs,
                norm,
            )
            .unwrap();
            let want = l.to_scalar::<f64>().unwrap();
            assert!((loss - want).abs() < 1e-12, "{count}: {loss} vs {want}");
            assert_eq!(
                (m.correct, m.counted, m.accepted, m.blocks),
                (wm.correct, wm.counted, wm.accepted, wm.blocks)
            );
            assert_eq!(
                autograd.keys().collect::<Vec<_>>(),
                written.keys().collect::<Vec<_>>()
            );
            for (name, a) in &autograd {
                let b = &written[name];
                assert_eq!(a.dims(), b.dims(), "{name}");
                let scale = crate::nn::testing::max_abs(a).max(1e-30);
                let diff = crate::nn::testing::max_diff(a, b);
                assert!(diff / scale < 1e-10, "{count} {name}: {diff} of {scale}");
            }
        }
    }

    /// As `train` runs it: weights cast once, then kept by AdamW (`step_keeping`) across steps.
    /// After each step the kept copy is what a fresh cast of the updated weights gives, and the
    /// weights are what AdamW without copies makes of the same gradients (f64 master weights,
    /// f32 steps: the copy's dtype differs from the weights', as bf16 from f32 on a GPU).
    #[test]
    fn kept_weights_follow_the_master_weights() {
        use crate::nn::AdamW;
        let target = crate::nn::drafter::tests::tiny_target(DType::F32);
        let config = DrafterConfig::for_target(&target.config, 1, vec![0, 2], 4, 39);
        let kept_run = Drafter::init(config.clone(), 3, DType::F64, &Device::Cpu).unwrap();
        let plain_run = Drafter::init(config, 3, DType::F64, &Device::Cpu).unwrap();
        let (seqs, batches) = crate::nn::drafter::tests::three_sequences();
        let context = target
            .tapped(&seqs[0].0, &kept_run.config.target_layers)
            .unwrap();
        let embed = |t: &Tensor| target.embed(t);
        let batch = [&batches[0]];
        let kept = super::ComputeWeights::of(&kept_run, DType::F32).unwrap();
        let (mut a, mut b) = (
            AdamW::new(&kept_run.vars, 0.1).unwrap(),
            AdamW::new(&plain_run.vars, 0.1).unwrap(),
        );
        for _ in 0..3 {
            let step = |d: &Drafter, w: Option<&super::ComputeWeights>| {
                loss_and_gradients(d, w, &embed, &target.lm_head, &context, &batch, 1.0).unwrap()
            };
            let (la, _, ga) = step(&kept_run, Some(&kept));
            let (lb, _, gb) = step(&plain_run, None);
            assert_eq!(la, lb);
            a.step_keeping(&kept_run.vars, &ga, 1e-2, 1.0, Some(kept.tensors()))
                .unwrap();
            b.step(&plain_run.vars, &gb, 1e-2, 1.0).unwrap();
            let fresh = super::ComputeWeights::of(&kept_run, DType::F32).unwrap();
            for (name, t) in kept.tensors() {
                let (w, v) = (&kept_run.vars[name], &plain_run.vars[name]);
                assert_eq!(
                    crate::nn::testing::max_diff(w.as_tensor(), v.as_tensor()),
                    0.0
                );
                assert_eq!(crate::nn::testing::max_diff(t, &fresh.tensors()[name]), 0.0);
            }
        }
    }

    /// DFlash 2 has no written-out backward: refused, not computed wrong.
    #[test]
    fn a_dflash2_drafter_is_refused() {
        let target = crate::nn::drafter::tests::tiny_target(DType::F64);
        let config = DrafterConfig::for_target(&target.config, 1, vec![0, 2], 4, 39).with_dflash2(
            crate::nn::dflash2::Dflash2Config {
                conv_kernel_size: 3,
                conv_group_size: 4,
                selector_rank: 3,
                selector_top_k: 6,
            },
        );
        let drafter = Drafter::init(config, 3, DType::F64, &Device::Cpu).unwrap();
        let (ids, mask) = crate::nn::drafter::tests::sequence();
        let batch = Batch::sample(&ids, &mask, 3, 4, 39, 2.0, 5).unwrap();
        let context = target.tapped(&ids, &drafter.config.target_layers).unwrap();
        let embed = |t: &Tensor| target.embed(t);
        let err = loss_and_gradients(
            &drafter,
            None,
            &embed,
            &target.lm_head,
            &context,
            &[&batch],
            1.0,
        )
        .unwrap_err();
        assert!(err.to_string().contains("DFlash 2"), "{err}");
    }
}
