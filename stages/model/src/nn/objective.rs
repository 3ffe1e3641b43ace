//! The DFlash training objective for one sequence (../shared/DFLASH.md): anchors sampled among
//! positions whose token and next token are both trained on; one block per anchor,
//! `[token_a, MASK x (B-1)]`, whose position k predicts token a+k; a mask letting each block see
//! the context strictly before its anchor and its own block, never other blocks; cross-entropy
//! at k = 1..B-1 weighted by exp(-(k-1)/gamma) and the label's loss mask.

use candle_core::{D, DType, Tensor};
use rand::SeedableRng;
use rand::seq::index;

use super::Result;
use super::drafter::Drafter;
use super::ops::BlockMask;
pub use super::written::{Backward, ComputeWeights};

/// One sequence's blocks, ready for the drafter.
#[derive(Clone, Debug)]
pub struct Batch {
    /// Anchor positions, ascending.
    pub anchors: Vec<usize>,
    /// Block tokens, `anchors.len() * B`.
    pub block_ids: Vec<u32>,
    /// Their absolute positions.
    pub block_pos: Vec<u32>,
    /// Per block position k >= 1 (row-major, `anchors.len() * (B-1)`): the label token.
    pub labels: Vec<u32>,
    /// Its loss weight (0 past the sequence's end or where the label is not trained on).
    pub weights: Vec<f32>,
    /// The sequence length (context positions).
    pub context_len: usize,
    /// Block size.
    pub block_size: usize,
}

/// Positions `p` with `loss_mask[p] == 1` and `loss_mask[p + 1] == 1`.
pub fn anchor_candidates(loss_mask: &[i8]) -> Vec<usize> {
    (0..loss_mask.len().saturating_sub(1))
        .filter(|&p| loss_mask[p] == 1 && loss_mask[p + 1] == 1)
        .collect()
}

/// The default gamma: 7 for B = 16, 4 for B = 8 (the reference's), else B / 2 - 1.
pub fn default_gamma(block_size: usize) -> f64 {
    match block_size {
        16 => 7.0,
        8 => 4.0,
        b => (b as f64 / 2.0 - 1.0).max(1.0),
    }
}

impl Batch {
    /// Sample up to `anchors` blocks from one sequence with a generator seeded by `seed` (so a
    /// resumed run draws the same blocks). `None` when no position can anchor a block.
    pub fn sample(
        ids: &[u32],
        loss_mask: &[i8],
        anchors: usize,
        block_size: usize,
        mask_token: u32,
        gamma: f64,
        seed: u64,
    ) -> Option<Self> {
        let candidates = anchor_candidates(loss_mask);
        if candidates.is_empty() {
            return None;
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let take = anchors.min(candidates.len());
        let mut chosen: Vec<usize> = index::sample(&mut rng, candidates.len(), take)
            .into_iter()
            .map(|i| candidates[i])
            .collect();
        chosen.sort_unstable();
        let n = ids.len();
        let mut b = Self {
            anchors: chosen.clone(),
            block_ids: Vec::with_capacity(take * block_size),
            block_pos: Vec::with_capacity(take * block_size),
            labels: Vec::with_capacity(take * (block_size - 1)),
            weights: Vec::with_capacity(take * (block_size - 1)),
            context_len: n,
            block_size,
        };
        for &a in &chosen {
            for k in 0..block_size {
                b.block_ids.push(if k == 0 { ids[a] } else { mask_token });
                b.block_pos.push((a + k) as u32);
                if k > 0 {
                    let at = a + k;
                    let (label, trained) = if at < n {
                        (ids[at], loss_mask[at] == 1)
                    } else {
                        (0, false)
                    };
                    b.labels.push(label);
                    let w = if trained {
                        (-((k - 1) as f64) / gamma).exp() as f32
                    } else {
                        0.0
                    };
                    b.weights.push(w);
                }
            }
        }
        Some(b)
    }

    /// Sum of the loss weights.
    pub fn weight(&self) -> f64 {
        self.weights.iter().map(|&w| f64::from(w)).sum()
    }

    /// What each block sees: the context positions before its anchor and all of its own
    /// block; other blocks are never in a block's keys ([`Drafter::forward_block`]).
    pub fn mask(&self) -> BlockMask {
        BlockMask::new(
            self.anchors.iter().map(|&a| a as u32).collect(),
            self.context_len,
            self.block_size,
        )
    }
}

/// What one step measured.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct StepMetrics {
    /// Weighted cross-entropy (the loss trained on).
    pub loss: f64,
    /// Per block position k = 1..B-1: predictions that equal the label, among trained labels.
    pub correct: Vec<u64>,
    /// Per block position: trained labels.
    pub counted: Vec<u64>,
    /// Sum over blocks of the number of leading correct predictions (accepted draft tokens).
    pub accepted: u64,
    /// Blocks.
    pub blocks: u64,
    /// Sum over blocks of `1 / (accepted + 1)`: the rounds a decode would spend per block
    /// position (see [`StepMetrics::tau_per_round`]).
    #[serde(default)]
    pub rounds: f64,
}

impl StepMetrics {
    /// Add another sequence's counts.
    pub fn add(&mut self, o: &Self) {
        self.loss += o.loss;
        if self.correct.is_empty() {
            self.correct = vec![0; o.correct.len()];
            self.counted = vec![0; o.counted.len()];
        }
        for (a, b) in self.correct.iter_mut().zip(&o.correct) {
            *a += b;
        }
        for (a, b) in self.counted.iter_mut().zip(&o.counted) {
            *a += b;
        }
        self.accepted += o.accepted;
        self.blocks += o.blocks;
        self.rounds += o.rounds;
    }

    /// Accuracy per block position.
    pub fn accuracy(&self) -> Vec<f64> {
        self.correct
            .iter()
            .zip(&self.counted)
            .map(|(&c, &n)| if n == 0 { 0.0 } else { c as f64 / n as f64 })
            .collect()
    }

    /// The acceptance length tau these blocks imply at T = 0: accepted drafts plus the bonus token.
    pub fn tau(&self) -> f64 {
        if self.blocks == 0 {
            0.0
        } else {
            1.0 + self.accepted as f64 / self.blocks as f64
        }
    }

    /// The tau a greedy decode along these sequences would measure (tokens per round), where
    /// [`StepMetrics::tau`] is the mean over anchors drawn anywhere. A decode does not draw its
    /// anchors: each round starts where the last one stopped, so a stretch the drafter gets
    /// right 15 at a time passes in few rounds and a stretch it gets wrong takes a round per
    /// token. Tokens per round is then the harmonic mean of `accepted + 1` over positions, not
    /// the arithmetic one, which long easy stretches (a reply repeating itself) inflate.
    pub fn tau_per_round(&self) -> f64 {
        if self.rounds <= 0.0 {
            0.0
        } else {
            self.blocks as f64 / self.rounds
        }
    }
}

/// Packed sequences' blocks as one pass takes them: every sequence's block tokens, positions,
/// labels and weights one after another, each sequence's context positions from 0, its mask.
pub(crate) struct Packed {
    pub bs: usize,
    pub blocks: usize,
    pub block_ids: Vec<u32>,
    pub block_pos: Vec<u32>,
    pub labels: Vec<u32>,
    pub weights: Vec<f32>,
    pub context_pos: Vec<u32>,
    pub masks: Vec<BlockMask>,
}

impl Packed {
    pub(crate) fn of(batches: &[&Batch]) -> Result<Self> {
        let Some(first) = batches.first() else {
            candle_core::bail!("a packed loss needs at least one sequence");
        };
        let bs = first.block_size;
        if batches.iter().any(|b| b.block_size != bs) {
            candle_core::bail!("packed sequences must share the block size");
        }
        let concat = |f: &dyn Fn(&Batch) -> &[u32]| -> Vec<u32> {
            batches.iter().flat_map(|b| f(b).iter().copied()).collect()
        };
        let block_ids = concat(&|b| &b.block_ids);
        Ok(Self {
            bs,
            blocks: block_ids.len() / bs,
            block_pos: concat(&|b| &b.block_pos),
            labels: concat(&|b| &b.labels),
            weights: batches
                .iter()
                .flat_map(|b| b.weights.iter().copied())
                .collect(),
            // Each sequence's rotary positions count from its own first token.
            context_pos: batches
                .iter()
                .flat_map(|b| 0..b.context_len as u32)
                .collect(),
            masks: batches.iter().map(|b| b.mask()).collect(),
            block_ids,
        })
    }
}

impl StepMetrics {
    /// The counts of a pass whose loss is `loss`: per block position, the rows with weight and
    /// those whose `predicted` token is the label; per block, the accepted run.
    pub(crate) fn of_rows(
        loss: f64,
        predicted: &[u32],
        labels: &[u32],
        weights: &[f32],
        bs: usize,
        blocks: usize,
    ) -> Self {
        let mut m = StepMetrics {
            loss,
            correct: vec![0; bs - 1],
            counted: vec![0; bs - 1],
            accepted: 0,
            blocks: blocks as u64,
            rounds: 0.0,
        };
        for j in 0..blocks {
            let mut leading = true;
            let mut accepted = 0u64;
            for k in 1..bs {
                let r = j * (bs - 1) + (k - 1);
                let hit = predicted[r] == labels[r];
                if weights[r] > 0.0 {
                    m.counted[k - 1] += 1;
                    m.correct[k - 1] += u64::from(hit);
                }
                leading &= hit && weights[r] > 0.0;
                accepted += u64::from(leading);
            }
            m.accepted += accepted;
            m.rounds += 1.0 / (accepted + 1) as f64;
        }
        m
    }
}

/// The drafter's loss on one sequence: `sum(w * nll) / normalizer` (a scalar tensor to
/// backpropagate), and what it measured. `context`: the tapped target layers `[s, n*H]`.
pub fn loss(
    drafter: &Drafter,
    embed: &dyn Fn(&Tensor) -> Result<Tensor>,
    lm_head: &Tensor,
    context: &Tensor,
    batch: &Batch,
    normalizer: f64,
) -> Result<(Tensor, StepMetrics)> {
    let head = Head::on(context.device());
    loss_packed(drafter, embed, lm_head, context, &[batch], normalizer, head)
}

/// How [`loss_packed`] runs the LM head and its cross-entropy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Head {
    /// The `[rows, vocab]` logits at once, then the fused cross-entropy.
    Whole,
    /// [`super::fused::head_cross_entropy`]: chunks of rows, the rows' gradient computed with
    /// the loss.
    Chunked,
}

impl Head {
    /// On a GPU the LM head and its loss run in chunks of rows, the logits never whole; on CPU
    /// the step stays what it always was, bit for bit.
    pub fn on(device: &candle_core::Device) -> Self {
        if device.is_cuda() {
            Self::Chunked
        } else {
            Self::Whole
        }
    }
}

/// [`loss`] summed over sequences packed into one pass: `context` holds their tapped rows one
/// sequence after another (`batches[i].context_len` rows each), so every projection, norm, MLP
/// and the LM head run once for all of them; no block sees another sequence
/// ([`Drafter::forward_packed`]). The sum of the sequences' losses, as separate passes would
/// give it, up to the rounding of matmuls over more rows. `head` says how the LM head runs
/// ([`Head::on`] the device, as `train` does).
pub fn loss_packed(
    drafter: &Drafter,
    embed: &dyn Fn(&Tensor) -> Result<Tensor>,
    lm_head: &Tensor,
    context: &Tensor,
    batches: &[&Batch],
    normalizer: f64,
    head: Head,
) -> Result<(Tensor, StepMetrics)> {
    let device = context.device();
    let dtype = context.dtype();
    let Packed {
        bs,
        blocks,
        block_ids,
        block_pos,
        labels,
        weights,
        context_pos,
        masks,
    } = Packed::of(batches)?;
    let ids = Tensor::new(block_ids.as_slice(), device)?;
    let block = embed(&ids)?.to_dtype(dtype)?;
    let ctx = drafter.context_kv(context, &context_pos)?;
    let hidden = drafter.forward_packed(&ctx, &block, &block_pos, &masks)?;
    // Rows k >= 1 of every block predict; row 0 (the anchor) is excluded.
    let rows: Vec<u32> = (0..blocks)
        .flat_map(|j| (1..bs).map(move |k| (j * bs + k) as u32))
        .collect();
    // A fused gather: its backward adds rows in parallel on a GPU (candle's `index_select`
    // backward walks every row index once per hidden column there).
    let hidden = super::fused::gather_rows(&hidden, &Tensor::new(rows.as_slice(), device)?)?;
    // DFlash's proposal is each row's likeliest token; DFlash 2 picks among the top k.
    let top = drafter
        .config
        .dflash2
        .as_ref()
        .map_or(1, |d| d.selector_top_k);
    let (nll, top) = match head {
        Head::Whole => {
            // The logits stay in the activations' dtype: the fused cross-entropy widens per
            // element. `linear` gives the frozen LM head no gradient (a plain matmul's backward
            // would).
            let logits = super::fused::linear(&hidden, &lm_head.to_dtype(dtype)?)?;
            let nll = super::fused::cross_entropy(&logits, &labels)?;
            let top = match top {
                1 => logits.argmax_keepdim(D::Minus1)?,
                k => super::dflash2::top_k(&logits, k)?,
            };
            (nll, top)
        }
        Head::Chunked => {
            let h = super::fused::head_cross_entropy(&hidden, lm_head, &labels, top)?;
            (h.nll, h.top)
        }
    };
    let weights_t = Tensor::new(weights.as_slice(), device)?.to_dtype(nll.dtype())?;
    let total = (nll.mul(&weights_t)?.sum_all()? / normalizer)?;

    // DFlash 2: the selector's loss, and its picks are what decoding would propose.
    let (total, predicted) = match &drafter.config.dflash2 {
        None => (total, top.flatten_all()?.to_vec1()?),
        Some(_) => {
            // Teacher forcing: the predecessor of position k is the true token k - 1 (the
            // anchor for k = 1): acceptance needs every token before k right.
            let predecessors: Vec<u32> = (0..blocks)
                .flat_map(|j| {
                    let anchor = block_ids[j * bs];
                    let labels = &labels[j * (bs - 1)..(j + 1) * (bs - 1)];
                    std::iter::once(anchor).chain(labels[..bs - 2].iter().copied())
                })
                .collect();
            let (selector, picks) = selector_loss(
                drafter,
                &hidden,
                &top,
                lm_head,
                &predecessors,
                &labels,
                &weights,
            )?;
            {
                // The selector's loss is in f32 at least, as the cross-entropy's.
                let selector = (selector / normalizer)?.to_dtype(total.dtype())?;
                ((total + selector)?, picks)
            }
        }
    };
    let loss = total.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    let m = StepMetrics::of_rows(loss, &predicted, &labels, &weights, bs, blocks);
    Ok((total, m))
}

/// [`loss_packed`]'s loss, its metrics and the gradient of every trainable tensor by name, by
/// `backward` ([`super::written::Backward::on`] the device and drafter, as `train` does): autograd
/// over the graph, or the written-out backward pass ([`super::written`], from `weights` if
/// kept across steps; its gradients in the compute dtype). The LM head runs as [`Head::on`]
/// the device says.
pub fn loss_and_gradients_packed(
    drafter: &Drafter,
    weights: Option<&super::written::ComputeWeights>,
    embed: &dyn Fn(&Tensor) -> Result<Tensor>,
    lm_head: &Tensor,
    context: &Tensor,
    batches: &[&Batch],
    normalizer: f64,
    backward: super::written::Backward,
) -> Result<(f64, StepMetrics, std::collections::BTreeMap<String, Tensor>)> {
    match backward {
        super::written::Backward::WrittenOut => super::written::loss_and_gradients(
            drafter, weights, embed, lm_head, context, batches, normalizer,
        ),
        super::written::Backward::Autograd => {
            let head = Head::on(context.device());
            let (loss, m) =
                loss_packed(drafter, embed, lm_head, context, batches, normalizer, head)?;
            let grads = drafter.gradients(&loss.backward()?);
            Ok((m.loss, m, grads))
        }
    }
}

/// The candidate selector's weighted cross-entropy (summed, not normalised) over each row's
/// top-k `candidates` `[rows, k]`, at rows whose label is among them ([`super::dflash2`]), and
/// the token it picks at every row after the true predecessor.
fn selector_loss(
    drafter: &Drafter,
    hidden: &Tensor,
    candidates: &Tensor,
    lm_head: &Tensor,
    predecessors: &[u32],
    labels: &[u32],
    weights: &[f32],
) -> Result<(Tensor, Vec<u32>)> {
    let device = hidden.device();
    let candidates = candidates.clone();
    let before = Tensor::new(predecessors, device)?;
    let unary = super::dflash2::candidate_logits(hidden, lm_head, &candidates)?;
    let scores = super::dflash2::scores(hidden, &unary, &candidates, &before, &|n| {
        drafter.w(n).clone()
    })?;
    let host: Vec<Vec<u32>> = candidates.to_vec2()?;
    let best: Vec<u32> = scores.argmax(D::Minus1)?.to_vec1()?;
    let picks: Vec<u32> = host
        .iter()
        .zip(&best)
        .map(|(c, &b)| c[b as usize])
        .collect();
    // Where the label is among the candidates: its index and the row's weight; else nothing.
    let (at, w): (Vec<u32>, Vec<f32>) = host
        .iter()
        .zip(labels.iter().zip(weights))
        .map(|(c, (l, &w))| match c.iter().position(|x| x == l) {
            Some(i) => (i as u32, w),
            None => (0, 0.0),
        })
        .unzip();
    let log_p = candle_nn::ops::log_softmax(&scores, D::Minus1)?
        .gather(&Tensor::new(at.as_slice(), device)?.unsqueeze(1)?, 1)?
        .squeeze(1)?;
    let w = Tensor::new(w.as_slice(), device)?.to_dtype(log_p.dtype())?;
    let loss = (log_p.mul(&w)?.sum_all()? * -1.0)?;
    Ok((loss, picks))
}

#[cfg(test)]
mod tests {
    use super::StepMetrics;

    /// Two anchors, one in a stretch the drafter gets wholly right (15 accepted), one where it
    /// gets nothing: drawn anywhere, tau is 8.5; a decode crossing 16 easy and 16 hard tokens
    /// takes 1 round and 16 rounds, 32 / 17 = 1.88 tokens a round, what `tau_per_round` says.
    #[test]
    fn tokens_per_round_is_the_harmonic_mean_of_the_acceptance_lengths() {
        let block = |accepted: u64| StepMetrics {
            accepted,
            blocks: 1,
            rounds: 1.0 / (accepted + 1) as f64,
            ..StepMetrics::default()
        };
        let mut m = StepMetrics::default();
        m.add(&block(15));
        m.add(&block(0));
        assert!((m.tau() - 8.5).abs() < 1e-12, "{}", m.tau());
        assert!(
            (m.tau_per_round() - 32.0 / 17.0).abs() < 1e-12,
            "{}",
            m.tau_per_round()
        );
        assert_eq!(StepMetrics::default().tau_per_round(), 0.0);
    }
}
