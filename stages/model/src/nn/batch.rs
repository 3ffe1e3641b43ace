//! Batched decoding for generation: many conversations advanced together through one forward
//! pass per step, so a GPU does one launch per op for the whole batch instead of one per
//! sequence. The prompts are left-padded to the longest, so every sequence's next token lands
//! in the same cache column and is written in place (`slice_set`) into one preallocated
//! `[batch, kv_heads, capacity, head_dim]` key and value tensor per layer; a mask hides each
//! sequence's padding, and each row's rotary position counts from its own first token, so a
//! sequence's logits are the ones it would get decoded alone. The prefill goes in runs of
//! neighbouring prompts of like length (the caller orders them longest first), each run from
//! the first column one of its rows uses, so a short prompt does not compute and attend over a
//! long one's padding.
//!
//! Grouped-query heads are multiplied without repeating the keys: the query heads that share a
//! key/value head are stacked as rows of one matrix against it.
//!
//! A hybrid target (Gated DeltaNet layers, whose state is per sequence) keeps a cache per
//! sequence and goes through [`Target::extend_last`]: its projections, norms, MLPs and LM head
//! run once for the whole batch, its attention and Gated DeltaNet layers per sequence.

use candle_core::{DType, Device, Tensor};

use super::Result;
use super::ops::Linear;
use super::target::Target;

/// Columns prefilled per pass (2 in the tests, so their short prompts take several).
const PREFILL_CHUNK: usize = if cfg!(test) { 2 } else { 256 };

/// A hybrid's prefill: at most this many prompt tokens per pass (whole prompts; a longer one
/// goes alone), so a large batch's stacked rows stay within memory.
const HYBRID_PREFILL_ROWS: usize = 8192;

/// Sequences decoded together; see the module docs.
pub struct BatchDecoder<'t> {
    target: &'t Target,
    /// Per layer: keys and values `[batch, kv_heads, capacity, head_dim]`.
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    /// Per sequence: the column of its first token (the padding is before it).
    start: Vec<u32>,
    /// Columns written so far.
    width: usize,
    capacity: usize,
    /// The LM head in f32, made once: a bf16 target's would otherwise be cast every step.
    lm_head: Linear,
    /// A hybrid target's sequences, each with its own cache (their Gated DeltaNet states are
    /// per sequence; the shared columns above are for attention only), stepped together.
    alone: Option<Vec<super::target::KvCache>>,
    /// Positions the prefill computed, padding included.
    prefilled: usize,
}

impl<'t> BatchDecoder<'t> {
    /// Prefill `prompts` (none empty) with room for `extra` more tokens each; returns the decoder
    /// and each prompt's next-token logits `[batch, vocab]` (f32).
    pub fn prefill(target: &'t Target, prompts: &[&[u32]], extra: usize) -> Result<(Self, Tensor)> {
        if prompts.is_empty() || prompts.iter().any(|p| p.is_empty()) {
            candle_core::bail!("batched prefill needs at least one prompt, none of them empty");
        }
        let c = &target.config;
        let device = target.embed.device();
        if c.hybrid.is_some() {
            let lm_head = Linear::Dense(target.lm_head.to_dtype(DType::F32)?);
            let mut caches = vec![super::target::KvCache::default(); prompts.len()];
            let mut logits = Vec::new();
            // Whole prompts per pass, up to the row budget.
            let (mut from, mut rows) = (0, 0);
            for (i, p) in prompts.iter().enumerate() {
                rows += p.len();
                let last = i + 1 == prompts.len();
                if last || rows + prompts[i + 1].len() > HYBRID_PREFILL_ROWS {
                    logits.push(target.extend_last(
                        &prompts[from..=i],
                        &mut caches[from..=i],
                        &lm_head,
                    )?);
                    (from, rows) = (i + 1, 0);
                }
            }
            let decoder = Self {
                target,
                keys: Vec::new(),
                values: Vec::new(),
                start: vec![0; prompts.len()],
                width: prompts.iter().map(|p| p.len()).max().unwrap_or(0),
                capacity: usize::MAX,
                lm_head,
                alone: Some(caches),
                prefilled: prompts.iter().map(|p| p.len()).sum(),
            };
            let logits = if logits.len() == 1 {
                logits.pop().expect("one")
            } else {
                Tensor::cat(&logits, 0)?
            };
            return Ok((decoder, logits));
        }
        let longest = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
        let capacity = longest + extra;
        let batch = prompts.len();
        let shape = (batch, c.kv_heads, capacity, c.head_dim);
        let zeros = || Tensor::zeros(shape, target.dtype, device);
        let mut decoder = Self {
            target,
            keys: (0..c.layers).map(|_| zeros()).collect::<Result<_>>()?,
            values: (0..c.layers).map(|_| zeros()).collect::<Result<_>>()?,
            start: prompts.iter().map(|p| (longest - p.len()) as u32).collect(),
            width: 0,
            capacity,
            lm_head: Linear::Dense(target.lm_head.to_dtype(DType::F32)?),
            alone: None,
            prefilled: 0,
        };
        // Runs of neighbouring rows of like length are prefilled apart, each from the first
        // column any of its rows uses: a short prompt beside a long one would otherwise compute
        // (and attend over) every padding column up to the long one's length.
        let mut logits = Vec::new();
        for rows in like_lengths(prompts) {
            let group = &prompts[rows.clone()];
            let skip = longest - group.iter().map(|p| p.len()).max().unwrap_or(0);
            // Padding takes token 0: its rows are masked out of every real row's attention.
            let width = longest - skip;
            let mut ids = Vec::with_capacity(group.len() * width);
            for p in group {
                ids.extend(std::iter::repeat_n(0u32, width - p.len()));
                ids.extend_from_slice(p);
            }
            let ids = Tensor::from_vec(ids, (group.len(), width), device)?;
            decoder.prefilled += group.len() * width;
            // In chunks of columns: the scores of one chunk are `[rows, heads, chunk, width]`,
            // where the whole prompt at once would be `width` wide in both.
            let mut last = None;
            for from in (0..width).step_by(PREFILL_CHUNK) {
                let n = PREFILL_CHUNK.min(width - from);
                let chunk = ids.narrow(1, from, n)?.contiguous()?;
                last = Some(decoder.forward_rows(&chunk, rows.start, skip + from, skip)?);
            }
            logits.push(last.expect("a non-empty prompt"));
        }
        decoder.width = longest;
        let logits = if logits.len() == 1 {
            logits.pop().expect("one")
        } else {
            Tensor::cat(&logits, 0)?
        };
        Ok((decoder, logits))
    }

    /// Feed one token per sequence (a finished sequence can be fed anything: its row is then
    /// wasted work, nothing else) and return the next-token logits `[batch, vocab]` (f32).
    pub fn step(&mut self, next: &[u32]) -> Result<Tensor> {
        if next.len() != self.start.len() {
            candle_core::bail!("{} tokens for {} sequences", next.len(), self.start.len());
        }
        if let Some(caches) = self.alone.as_mut() {
            let seqs: Vec<&[u32]> = next.iter().map(std::slice::from_ref).collect();
            let logits = self.target.extend_last(&seqs, caches, &self.lm_head)?;
            self.width += 1;
            return Ok(logits);
        }
        if self.width >= self.capacity {
            candle_core::bail!("the batch's cache is full ({} columns)", self.capacity);
        }
        let ids = Tensor::from_slice(next, (next.len(), 1), self.target.embed.device())?;
        let logits = self.forward_rows(&ids, 0, self.width, 0)?;
        self.width += 1;
        Ok(logits)
    }

    /// Columns written so far (the longest prompt plus the steps taken).
    pub fn width(&self) -> usize {
        self.width
    }

    /// Positions the prefill computed, padding included (the prompts' tokens when none).
    pub fn prefilled(&self) -> usize {
        self.prefilled
    }

    /// Run `ids` `[rows, n]` as columns `from..from + n` of the batch's rows `first..first +
    /// rows`, attending over columns `skip..` (those before are padding for all of them); the
    /// logits at the last column. The caller moves `width`.
    fn forward_rows(
        &mut self,
        ids: &Tensor,
        first: usize,
        from: usize,
        skip: usize,
    ) -> Result<Tensor> {
        let t = self.target;
        let c = &t.config;
        let device = t.embed.device();
        let (batch, n) = ids.dims2()?;
        let to = from + n;
        let groups = c.heads / c.kv_heads;
        let starts = &self.start[first..first + batch];
        // Each row's rotary position counts from its own first token.
        let positions: Vec<u32> = starts
            .iter()
            .flat_map(|&s| (from..to).map(move |col| (col as u32).saturating_sub(s)))
            .collect();
        let (cos, sin) =
            super::ops::rope_tables(&positions, c.head_dim, c.rope_theta, t.dtype, device)?;
        let half = c.head_dim / 2;
        let (cos, sin) = (
            cos.reshape((batch, n, half))?,
            sin.reshape((batch, n, half))?,
        );
        let mask = mask(starts, from, n, skip, device)?;
        let seen = to - skip;
        let scale = 1.0 / (c.head_dim as f64).sqrt();
        let rope = if t.rope_interleaved {
            candle_nn::rotary_emb::rope_i
        } else {
            candle_nn::rotary_emb::rope
        };
        let mut x = t.embed(&ids.flatten_all()?)?;
        for (i, layer) in t.layers.iter().enumerate() {
            let attn = layer.attention()?;
            let h = super::target::fused_norm(&x, &layer.attn_norm, c.eps)?;
            // [batch * n, heads * d] -> [batch, heads, n, d]
            let split = |y: Tensor, heads: usize| -> Result<Tensor> {
                y.reshape((batch, n, heads, c.head_dim))?
                    .transpose(1, 2)?
                    .contiguous()
            };
            let mut q = split(attn.q.forward(&h)?, c.heads)?;
            let mut k = split(attn.k.forward(&h)?, c.kv_heads)?;
            let v = split(attn.v.forward(&h)?, c.kv_heads)?;
            if let (Some(qn), Some(kn)) = (&attn.q_norm, &attn.k_norm) {
                q = super::target::fused_norm(&q, qn, c.eps)?;
                k = super::target::fused_norm(&k, kn, c.eps)?;
            }
            let (q, k) = (rope(&q, &cos, &sin)?, rope(&k, &cos, &sin)?);
            let (cache_k, cache_v) = (
                self.keys[i].narrow(0, first, batch)?,
                self.values[i].narrow(0, first, batch)?,
            );
            cache_k.slice_set(&k, 2, from)?;
            cache_v.slice_set(&v, 2, from)?;
            let keys = cache_k.narrow(2, skip, seen)?;
            let values = cache_v.narrow(2, skip, seen)?;
            // The query heads of one key/value head, stacked: [batch, kv_heads, groups * n, d].
            let q = q.reshape((batch, c.kv_heads, groups * n, c.head_dim))?;
            let scores = (q.matmul(&keys.t()?)? * scale)?
                .to_dtype(DType::F32)?
                .reshape((batch, c.kv_heads, groups, n, seen))?
                .broadcast_add(&mask)?;
            let probs = candle_nn::ops::softmax_last_dim(&scores)?
                .to_dtype(t.dtype)?
                .reshape((batch, c.kv_heads, groups * n, seen))?;
            let a = probs
                .matmul(&values)?
                .reshape((batch, c.heads, n, c.head_dim))?
                .transpose(1, 2)?
                .reshape((batch * n, c.heads * c.head_dim))?;
            x = (x + attn.o.forward(&a)?)?;
            let h = super::target::fused_norm(&x, &layer.ffn_norm, c.eps)?;
            x = (&x + layer.mlp(&h)?)?;
        }
        let last = x
            .reshape((batch, n, c.hidden))?
            .narrow(1, n - 1, 1)?
            .squeeze(1)?;
        let h = super::target::fused_norm(&last, &t.norm, c.eps)?;
        self.lm_head.forward(&h.to_dtype(DType::F32)?)
    }
}

/// The additive mask `[rows, 1, 1, n, from + n - skip]` (f32) for columns `from..from + n` of
/// rows starting at `starts`, over columns `skip..from + n`: a row sees its sequence's columns
/// up to itself, never the padding; a padding row sees itself (so its softmax has something to
/// normalise; nothing reads it).
fn mask(starts: &[u32], from: usize, n: usize, skip: usize, device: &Device) -> Result<Tensor> {
    let (from, to, skip) = (from as u32, (from + n) as u32, skip as u32);
    let batch = starts.len();
    let seen = (to - skip) as usize;
    let cols = Tensor::arange(skip, to, device)?.reshape((1, 1, seen))?;
    let rows = Tensor::arange(from, to, device)?.reshape((1, n, 1))?;
    let start = Tensor::new(starts, device)?.reshape((batch, 1, 1))?;
    let causal = cols.broadcast_le(&rows)?;
    let own = cols.broadcast_ge(&start)?;
    let itself = cols.broadcast_eq(&rows)?;
    let open = causal.broadcast_mul(&own)?.broadcast_maximum(&itself)?;
    let zeros = Tensor::zeros(open.shape(), DType::F32, device)?;
    let closed = Tensor::full(f32::NEG_INFINITY, open.shape(), device)?;
    open.where_cond(&zeros, &closed)?
        .reshape((batch, 1, 1, n, seen))
}

/// Runs of neighbouring prompts to prefill together: a run grows while its rows padded to its
/// longest stay within a quarter more positions than its tokens (the caller orders prompts by
/// length, longest first, so a wave's runs are few).
fn like_lengths(prompts: &[&[u32]]) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let (mut start, mut longest, mut tokens) = (0, 0, 0);
    for (i, p) in prompts.iter().enumerate() {
        let (l, t) = (longest.max(p.len()), tokens + p.len());
        if i > start && 4 * (i + 1 - start) * l > 5 * t {
            runs.push(start..i);
            (start, longest, tokens) = (i, p.len(), p.len());
        } else {
            (longest, tokens) = (l, t);
        }
    }
    runs.push(start..prompts.len());
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::target::KvCache;

    fn tiny(family: &str, qk_norm: bool) -> Target {
        crate::nn::testing::tiny_target(family, qk_norm, 3)
    }

    use crate::nn::testing::max_diff;

    /// Each sequence of a padded batch gets the logits it gets decoded alone, at the prefill
    /// and at every step after it, prompts of different lengths together: in the order given
    /// (each prefilled apart) and longest first (three prefilled together, then the short one
    /// from the column where it starts).
    #[test]
    fn a_batch_decodes_each_sequence_as_it_decodes_alone() {
        let given: [&[u32]; 3] = [&[5, 9, 2, 7, 1], &[3], &[8, 8, 4]];
        let sorted: [&[u32]; 4] = [&[5, 9, 2, 7, 1], &[6, 1, 8, 3, 3], &[8, 8, 4, 2], &[7]];
        assert_eq!(like_lengths(&given), vec![0..1, 1..2, 2..3]);
        assert_eq!(like_lengths(&sorted), vec![0..3, 3..4]);
        // One prompt, and prompts of one length, are one run; a run may grow past a shorter
        // row while the padding stays within a quarter.
        assert_eq!(like_lengths(&[&[1, 2][..]]), vec![0..1]);
        assert_eq!(like_lengths(&[&[1, 2][..], &[3, 4], &[5, 6]]), vec![0..3]);
        assert_eq!(
            like_lengths(&[&[1; 8][..], &[2; 7], &[3; 2]]),
            vec![0..2, 2..3]
        );
        for (family, qk_norm, prompts) in [
            ("llama", false, &given[..]),
            ("qwen3", true, &given[..]),
            ("llama", false, &sorted[..]),
            ("qwen3", true, &sorted[..]),
        ] {
            let target = tiny(family, qk_norm);
            let rows = prompts.len();
            let (mut batch, mut logits) =
                BatchDecoder::prefill(&target, prompts, 6).expect("prefill");
            let mut alone: Vec<(KvCache, Tensor)> = prompts
                .iter()
                .map(|p| {
                    let mut cache = KvCache::default();
                    let (l, _) = target.extend(p, &mut cache, &[]).expect("extend");
                    (cache, l.narrow(0, p.len() - 1, 1).expect("last"))
                })
                .collect();
            for step in 0..6u32 {
                for (row, (_, l)) in alone.iter().enumerate() {
                    let diff = max_diff(&logits.narrow(0, row, 1).expect("row"), l);
                    assert!(diff < 1e-4, "{family}, step {step}, row {row}: {diff}");
                }
                let next: Vec<u32> = (0..rows as u32).map(|r| (step * 7 + r * 11) % 50).collect();
                logits = batch.step(&next).expect("step");
                for ((cache, l), &t) in alone.iter_mut().zip(&next) {
                    *l = target.extend(&[t], cache, &[]).expect("extend").0;
                }
            }
            assert_eq!(batch.width(), 5 + 6);
            // Each run padded to its own longest: 5 + 1 + 3, and 3 x 5 + 1.
            assert_eq!(batch.prefilled(), if rows == 3 { 9 } else { 16 });
            assert!(batch.step(&vec![1; rows]).is_err(), "past the capacity");
        }
    }

    /// The target's taps for a micro-batch in one pass equal each sequence's taps alone, to
    /// rounding (a matmul over more rows may sum in another order).
    #[test]
    fn stacked_taps_equal_each_sequence_alone() {
        let target = tiny("qwen3", true);
        let seqs: [&[u32]; 3] = [&[5, 9, 2, 7, 1], &[3], &[8, 8, 4, 1]];
        let stacked = target.tapped_batch(&seqs, &[0, 1]).expect("batch");
        assert_eq!(stacked.len(), 3);
        for (ids, got) in seqs.iter().zip(&stacked) {
            let alone = target.tapped(ids, &[0, 1]).expect("alone");
            assert_eq!(got.dims(), alone.dims());
            let diff = max_diff(got, &alone);
            assert!(diff < 1e-6, "{ids:?}: {diff}");
        }
    }
}
