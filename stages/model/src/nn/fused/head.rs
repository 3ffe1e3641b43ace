//! The LM head's matmul and the cross-entropy after it, in chunks of rows, so that a step's
//! `[rows, vocab]` logits never exist whole, forward or backward.
//!
//! At the Qwen3-8B shape a step predicts 7,680 rows (512 anchors x 15) over 151,936 tokens:
//! 2.3 GB of bf16 logits, kept by the graph for the cross-entropy's backward, and a gradient of
//! the same size. Here each chunk's logits live only while the chunk is worked on: its
//! cross-entropy, its top-k (what the metrics and DFlash 2's candidates need), and, when a
//! gradient will be asked for, the loss's gradient in the hidden rows computed there and then
//! (`(softmax - onehot) @ W`, `[rows, H]`), as fused linear-cross-entropy kernels do. The
//! backward only scales those rows by each row's incoming gradient, so the head's matmuls run
//! twice a step (logits, then the rows' gradient), as unfused, and nothing is recomputed.
//!
//! The result equals [`super::linear`] then [`super::cross_entropy`] up to rounding: the
//! per-row gradient scale is applied after the `[rows, vocab] @ [vocab, H]` matmul instead of
//! before it.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, bail};

use super::Result;
use super::loss::CrossEntropyGrad;
use super::nodes::{handed_over, on_cpu};

/// At most this many bytes of logits at a time (`dflash estimate` counts the same).
const CHUNK_BYTES: usize = crate::drafter::LM_HEAD_CHUNK_BYTES;

/// What [`head_cross_entropy`] gives for every row.
#[derive(Debug)]
pub struct HeadLoss {
    /// `logsumexp(logits) - logits[label]`, `[rows]`, f32 (f64 for f64 rows); differentiable in
    /// the hidden rows.
    pub nll: Tensor,
    /// The `top` largest logits' token ids, `[rows, top]` `u32`, largest first (ties to the
    /// lower id, as argmax).
    pub top: Tensor,
}

/// The cross-entropy of `hidden` `[rows, H]` through the frozen `lm_head` `[vocab, H]` against
/// `labels`, and each row's `top` likeliest tokens, in chunks of rows (module docs). The head
/// gets no gradient.
pub fn head_cross_entropy(
    hidden: &Tensor,
    lm_head: &Tensor,
    labels: &[u32],
    top: usize,
) -> Result<HeadLoss> {
    head_cross_entropy_in(hidden, lm_head, labels, top, chunk_rows(hidden, lm_head)?)
}

/// Rows per chunk: at most [`CHUNK_BYTES`] of logits.
fn chunk_rows(hidden: &Tensor, lm_head: &Tensor) -> Result<usize> {
    let vocab = lm_head.dim(0)?;
    Ok(CHUNK_BYTES / (vocab * hidden.dtype().size_in_bytes()).max(1))
}

/// [`head_cross_entropy`] of untracked rows, and each row's gradient in `hidden` per unit of
/// its loss's gradient (`(softmax - onehot) @ W`, `[rows, H]`): for a step whose backward is
/// written out, which scales the rows by their weights itself.
pub fn head_cross_entropy_rows(
    hidden: &Tensor,
    lm_head: &Tensor,
    labels: &[u32],
    top: usize,
) -> Result<(HeadLoss, Tensor)> {
    let chunk = chunk_rows(hidden, lm_head)?;
    let (nll, top, d_hidden) = head_chunks(hidden, lm_head, labels, top, chunk, true)?;
    let d_hidden = d_hidden.ok_or_else(|| candle_core::Error::Msg("no rows".into()))?;
    Ok((HeadLoss { nll, top }, d_hidden))
}

/// [`head_cross_entropy`] in chunks of `chunk` rows.
pub(super) fn head_cross_entropy_in(
    hidden: &Tensor,
    lm_head: &Tensor,
    labels: &[u32],
    top: usize,
    chunk: usize,
) -> Result<HeadLoss> {
    let tracked = hidden.track_op();
    let (nll, top, d_hidden) = head_chunks(hidden, lm_head, labels, top, chunk, tracked)?;
    let Some(d_hidden) = d_hidden else {
        return Ok(HeadLoss { nll, top });
    };
    let nll = hidden.apply_op1(HeadNode { nll, d_hidden })?;
    Ok(HeadLoss { nll, top })
}

/// The chunks' losses, top-k and, given `grad`, the rows' unscaled gradient (none for no rows).
fn head_chunks(
    hidden: &Tensor,
    lm_head: &Tensor,
    labels: &[u32],
    top: usize,
    chunk: usize,
    grad: bool,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let (m, h) = hidden.dims2()?;
    let (_, h2) = lm_head.dims2()?;
    if h != h2 {
        bail!("head cross-entropy: rows of {h} against a head of {h2}");
    }
    if labels.len() != m {
        bail!("head cross-entropy: {m} rows, {} labels", labels.len());
    }
    let dtype = hidden.dtype();
    let device = hidden.device();
    let x = hidden.detach();
    let w = lm_head.detach().to_dtype(dtype)?;
    let wt = w.t()?;
    let chunk = chunk.clamp(1, m.max(1));
    let (mut nll, mut tops, mut grads) = (Vec::new(), Vec::new(), Vec::new());
    let one_pass = grad && top == 1 && one_pass_enabled(device, dtype);
    for start in (0..m).step_by(chunk) {
        let n = chunk.min(m - start);
        let logits = x.narrow(0, start, n)?.matmul(&wt)?;
        let labels = &labels[start..start + n];
        if one_pass {
            // The chunk's fresh logits become the rows' gradient in place.
            let (l, t) = head_rows_in_place(&logits, labels)?;
            nll.push(l);
            tops.push(t);
            grads.push(logits.matmul(&w)?);
            continue;
        }
        nll.push(super::cross_entropy(&logits, labels)?);
        tops.push(super::super::dflash2::top_k(&logits, top)?);
        if grad {
            // The gradient of each row's loss in its logits, unscaled: softmax - onehot.
            let ones = Tensor::ones(n, super::loss::loss_dtype(dtype), device)?;
            let labels = Tensor::new(labels, device)?;
            let d_logits = logits.apply_op3_no_bwd(&labels, &ones, &CrossEntropyGrad {})?;
            grads.push(d_logits.matmul(&w)?);
        }
    }
    let cat = |parts: Vec<Tensor>| -> Result<Tensor> {
        if parts.len() == 1 {
            Ok(parts.into_iter().next().expect("one"))
        } else {
            Tensor::cat(&parts, 0)
        }
    };
    let top = cat(tops)?;
    let nll = cat(nll)?;
    let d_hidden = if grad && m > 0 {
        Some(cat(grads)?)
    } else {
        None
    };
    Ok((nll, top, d_hidden))
}

/// Whether a chunk's loss, argmax and gradient come from one kernel (`head_rows` on a GPU, the
/// logits read twice where three kernels read them five times), instead of `cross_entropy`,
/// `top_k` and `cross_entropy_grad`: on a GPU unless `DFLASH_HEAD_ROWS=separate` (the three,
/// kept for comparison). Checked against the three on an H100 (`train_probe fused`,
/// `head_rows`: losses within 1.9e-6, the same argmaxes); the step 7 ms faster with it.
fn one_pass_enabled(device: &candle_core::Device, dtype: DType) -> bool {
    cfg!(feature = "cuda")
        && device.is_cuda()
        && matches!(dtype, DType::BF16 | DType::F32)
        && !separate_head_rows()
}

/// `DFLASH_HEAD_ROWS=separate`, read once per process.
fn separate_head_rows() -> bool {
    static SEPARATE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SEPARATE.get_or_init(|| std::env::var("DFLASH_HEAD_ROWS").is_ok_and(|v| v == "separate"))
}

/// For fresh logits `[rows, vocab]` on a GPU (their own storage, overwritten) and each row's
/// label: each row's cross-entropy (`[rows]`, f32) and argmax (`[rows, 1]`, `u32`), the logits
/// left holding `softmax - onehot` (`head_rows`, one kernel). A label past the vocabulary is
/// refused.
pub fn head_rows_in_place(logits: &Tensor, labels: &[u32]) -> Result<(Tensor, Tensor)> {
    let (rows, vocab) = logits.dims2()?;
    if labels.len() != rows || labels.iter().any(|&y| y as usize >= vocab) {
        bail!(
            "head rows: {rows} rows of {vocab} logits, labels {} (each < {vocab})",
            labels.len()
        );
    }
    #[cfg(feature = "cuda")]
    {
        let device = logits.device();
        let y = Tensor::new(labels, device)?;
        let nll = Tensor::zeros(rows, DType::F32, device)?;
        let top = Tensor::zeros((rows, 1), DType::U32, device)?;
        super::cuda::head_rows(logits, &y, &nll, &top)?;
        Ok((nll, top))
    }
    #[cfg(not(feature = "cuda"))]
    bail!("head rows: a kernel of GPU builds (`--features cuda`)")
}

/// The graph node of [`head_cross_entropy`]: the losses computed untracked, and each row's
/// gradient in the hidden rows per unit of its loss's gradient.
struct HeadNode {
    nll: Tensor,
    d_hidden: Tensor,
}

impl CustomOp1 for HeadNode {
    fn name(&self) -> &'static str {
        "head-cross-entropy"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        handed_over(&self.nll, on_cpu)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        handed_over(&self.nll, super::nodes::on_cuda)
    }

    fn bwd(&self, hidden: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // In f32 at least (f64 rows stay f64): the scale is the loss's weight per row.
        let wide = if self.d_hidden.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let scale = grad.to_dtype(wide)?;
        let d = self
            .d_hidden
            .to_dtype(scale.dtype())?
            .broadcast_mul(&scale.unsqueeze(1)?)?;
        Ok(Some(d.to_dtype(hidden.dtype())?))
    }
}
