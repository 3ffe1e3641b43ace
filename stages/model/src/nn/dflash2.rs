//! DFlash 2's two additions to the drafter (the reference package `dflash==0.1.0`,
//! `DFlash2DraftModel`), and how they are trained here.
//!
//! - **Grouped dynamic causal convolution** around each layer's attention and MLP: the normed
//!   input is mixed with the `K - 1` positions before it, per channel, by a learned base kernel
//!   plus a per-position, per-group kernel projected from that input; the sublayer's output is
//!   mixed the same way with the second half of the projection. It runs along the block's
//!   positions only (a drafted block is the sequence the reference's layer sees), so in a packed
//!   training pass every block is convolved on its own, zero-padded at its anchor.
//! - **Candidate selector**: at each block position the drafter's top-k tokens are re-scored
//!   with a low-rank bilinear term between the token chosen before it (its predecessor codebook
//!   row), the position's hidden state (projected to the rank) and the candidate (its successor
//!   codebook row), and chosen left to right, the anchor token being the first predecessor.
//!
//! The reference ships the model, not its training. The objective here follows from how the
//! selector decodes: a draft is accepted only while every token before it was right, so the
//! predecessor that matters at position k is the true token k - 1 (teacher forcing), and the
//! selector's job is to pick the true token among the candidates. Its loss is the cross-entropy
//! over the top-k candidates at each block position whose label is among them (the rest it can
//! never pick), with the DFlash position weights, added to DFlash's vocabulary-wide
//! cross-entropy. The drafter's logits are the unary score and get this loss's gradient too: it
//! asks them for what decoding needs, the label first among the candidates. Only the choice of
//! candidates is discrete (no gradient). Initialised as the identity (base kernel
//! 1 at offset 0, projections 0) and with small codebooks, a fresh DFlash 2 drafter decodes as a
//! DFlash one.

use candle_core::{D, DType, Tensor};

use super::Result;

pub use crate::drafter::{Dflash2Config, HIDDEN_PROJECTION, PREDECESSOR, SUCCESSOR};

/// The starting value of a DFlash 2 tensor that is not drawn at random: the base kernels pass
/// the position through (1 at offset 0), the kernel projections add nothing. `None` for the
/// tensors drawn like the rest of the drafter.
pub fn initial(name: &str, shape: &[usize]) -> Option<Vec<f32>> {
    if name.ends_with(".base_kernel") {
        let (k, h) = (shape[1], shape[2]);
        let mut v = vec![0f32; shape.iter().product()];
        for half in 0..2 {
            v[half * k * h..half * k * h + h].fill(1.0);
        }
        return Some(v);
    }
    if name.ends_with(".kernel_projection.weight") {
        return Some(vec![0f32; shape.iter().product()]);
    }
    None
}

/// One half of a grouped dynamic causal convolution over blocks of `block` rows: row t of each
/// block becomes `sum_o (base[o] + dynamic[t, o, group]) * x[t - o]` (zero before the block's
/// first row). `x` `[m, H]`, `dynamic` `[m, K, G]`, `base` `[K, H]`.
pub fn convolve(x: &Tensor, dynamic: &Tensor, base: &Tensor, block: usize) -> Result<Tensor> {
    let (m, h) = x.dims2()?;
    let (_, k, g) = dynamic.dims3()?;
    if block == 0 || m % block != 0 {
        candle_core::bail!("{m} rows are not whole blocks of {block}");
    }
    if k == 0 {
        candle_core::bail!("a convolution needs at least one tap");
    }
    let blocks = m / block;
    let x = x.reshape((blocks, block, h))?;
    // Each group's scalar spread over its channels.
    let dynamic = dynamic
        .reshape((blocks, block, k, g, 1))?
        .broadcast_as((blocks, block, k, g, h / g))?
        .reshape((blocks, block, k, h))?;
    let base = base.to_dtype(x.dtype())?;
    let mut out: Option<Tensor> = None;
    for o in 0..k.min(block) {
        let shifted = if o == 0 {
            x.clone()
        } else {
            x.narrow(1, 0, block - o)?.pad_with_zeros(1, o, 0)?
        };
        let kernel = dynamic
            .narrow(2, o, 1)?
            .squeeze(2)?
            .broadcast_add(&base.narrow(0, o, 1)?.reshape((1, 1, h))?)?;
        let term = (shifted * kernel)?;
        out = Some(match out {
            Some(acc) => (acc + term)?,
            None => term,
        });
    }
    out.expect("at least one tap").reshape((m, h))
}

/// The two dynamic kernels `[m, K, G]` (before the sublayer, after it) projected from `x`.
pub fn dynamic_kernels(
    x: &Tensor,
    projection: &Tensor,
    config: &Dflash2Config,
) -> Result<(Tensor, Tensor)> {
    let m = x.dim(0)?;
    let (k, g) = (
        config.conv_kernel_size,
        projection.dim(0)? / (2 * config.conv_kernel_size),
    );
    let d = x.matmul(&projection.to_dtype(x.dtype())?.t()?)?;
    Ok((
        d.narrow(1, 0, k * g)?.reshape((m, k, g))?,
        d.narrow(1, k * g, k * g)?.reshape((m, k, g))?,
    ))
}

/// Each row's `k` largest logits' token ids `[n, k]`, largest first (detached: the candidates
/// are a discrete choice).
pub fn top_k(logits: &Tensor, k: usize) -> Result<Tensor> {
    // One pass, fused (the same indices in the same order as the argmaxes below).
    if k <= super::fused::TOP_K_MAX && k <= logits.dim(D::Minus1)? {
        return super::fused::top_k(&logits.detach(), k);
    }
    // In the logits' own dtype: a training step's logits are rows x vocabulary (gigabytes), and
    // each pass below makes one copy.
    let mut l = logits.detach();
    let n = l.dim(0)?;
    let mut picked = Vec::with_capacity(k);
    let floor = Tensor::full(f32::NEG_INFINITY, (n, 1), l.device())?.to_dtype(l.dtype())?;
    for _ in 0..k {
        let idx = l.argmax_keepdim(D::Minus1)?;
        l = l.scatter(&idx, &floor, 1)?;
        picked.push(idx);
    }
    Tensor::cat(&picked, 1)
}

/// The drafter's logits of `candidates` `[n, k]` at rows whose final hidden states are `hidden`
/// `[n, H]`: each the hidden state times the candidate's LM-head row. Equal to gathering them
/// from the `[n, vocab]` logits, but its gradient reaches `hidden` through `[n, k, H]`, not
/// through a `[n, vocab]` buffer that is zeros but for k entries a row.
pub fn candidate_logits(hidden: &Tensor, lm_head: &Tensor, candidates: &Tensor) -> Result<Tensor> {
    let (n, k) = candidates.dims2()?;
    let h = hidden.dim(1)?;
    // The candidates' rows, then their dtype: converting the whole head would copy
    // vocabulary x hidden every step.
    let rows = lm_head
        .index_select(&candidates.flatten_all()?, 0)?
        .to_dtype(hidden.dtype())?
        .reshape((n, k, h))?;
    rows.matmul(&hidden.unsqueeze(2)?)?.squeeze(2)
}

/// The selector's scores `[n, k]` of `candidates` `[n, k]` at rows whose final hidden states are
/// `hidden` `[n, H]`, after `predecessors` `[n]`: the drafter's logits of the candidates
/// (`unary`, `[n, k]`) plus the bilinear term.
pub fn scores(
    hidden: &Tensor,
    unary: &Tensor,
    candidates: &Tensor,
    predecessors: &Tensor,
    weights: &dyn Fn(&str) -> Tensor,
) -> Result<Tensor> {
    let (n, k) = candidates.dims2()?;
    // Scores in f32 at least (f64 stays f64: the gradient checks).
    let dtype = super::ops::wide(hidden.dtype());
    let unary = unary.to_dtype(dtype)?;
    let projected = hidden
        .matmul(&weights(HIDDEN_PROJECTION).to_dtype(hidden.dtype())?.t()?)?
        .to_dtype(dtype)?;
    let r = projected.dim(1)?;
    // The codebooks' rows by a fused gather: its backward adds the rows' gradients in
    // parallel (candle's `index_select` backward walks every index once per column on a GPU).
    let before = super::fused::gather_rows(&weights(PREDECESSOR).to_dtype(dtype)?, predecessors)?;
    let after = super::fused::gather_rows(
        &weights(SUCCESSOR).to_dtype(dtype)?,
        &candidates.flatten_all()?,
    )?
    .reshape((n, k, r))?;
    let query = (before * projected)?.unsqueeze(2)?; // [n, r, 1]
    let pair = after.matmul(&query)?.squeeze(2)?; // [n, k]
    unary + pair
}

/// The selector's greedy choice at each row of `hidden` `[n, H]` / `logits` `[n, V]` (a block's
/// positions after `anchor`, in order), as the reference's `CandidateSelector.select` at T = 0.
pub fn select(
    hidden: &Tensor,
    logits: &Tensor,
    anchor: u32,
    config: &Dflash2Config,
    weights: &dyn Fn(&str) -> Tensor,
) -> Result<Vec<u32>> {
    Ok(Scorer::new(hidden, logits, anchor, config, weights)?.greedy(anchor))
}

/// The selector's scores for one drafted block, on the host: for a tree, each node's children
/// are scored after that node's token.
pub struct Scorer {
    unary: Vec<Vec<f32>>,
    candidates: Vec<Vec<u32>>,
    projected: Vec<Vec<f32>>,
    successor: Vec<Vec<Vec<f32>>>,
    /// The predecessor code of every token that can be a parent: the anchor and each position's
    /// candidates.
    predecessor: std::collections::HashMap<u32, Vec<f32>>,
}

impl Scorer {
    /// Host copies of what scoring the block `hidden` / `logits` (positions after `anchor`)
    /// needs.
    pub fn new(
        hidden: &Tensor,
        logits: &Tensor,
        anchor: u32,
        config: &Dflash2Config,
        weights: &dyn Fn(&str) -> Tensor,
    ) -> Result<Self> {
        let candidates = top_k(logits, config.selector_top_k)?;
        let k = candidates.dim(1)?;
        let unary: Vec<Vec<f32>> = logits
            .gather(&candidates, 1)?
            .to_dtype(DType::F32)?
            .to_vec2()?;
        let projected: Vec<Vec<f32>> = hidden
            .matmul(&weights(HIDDEN_PROJECTION).to_dtype(hidden.dtype())?.t()?)?
            .to_dtype(DType::F32)?
            .to_vec2()?;
        let flat = candidates.flatten_all()?;
        let rows = |name: &str, ids: &Tensor| -> Result<Vec<Vec<f32>>> {
            weights(name)
                .index_select(ids, 0)?
                .to_dtype(DType::F32)?
                .to_vec2()
        };
        let successor = rows(SUCCESSOR, &flat)?
            .chunks(k)
            .map(<[Vec<f32>]>::to_vec)
            .collect();
        let tokens: Vec<u32> = flat.to_vec1()?;
        let mut predecessor: std::collections::HashMap<u32, Vec<f32>> = tokens
            .iter()
            .copied()
            .zip(rows(PREDECESSOR, &flat)?)
            .collect();
        let anchor_row = weights(PREDECESSOR)
            .get(anchor as usize)?
            .to_dtype(DType::F32)?
            .to_vec1()?;
        predecessor.insert(anchor, anchor_row);
        Ok(Self {
            unary,
            candidates: candidates.to_vec2()?,
            projected,
            successor,
            predecessor,
        })
    }

    /// The selector's score of each candidate at `depth` after `token`: the drafter's logit
    /// plus the bilinear term (none for a token with no predecessor code here).
    fn scores(&self, depth: usize, token: u32) -> Vec<f32> {
        let before = self.predecessor.get(&token);
        (0..self.candidates[depth].len())
            .map(|j| {
                let pair = before.map_or(0.0, |before| {
                    before
                        .iter()
                        .zip(&self.projected[depth])
                        .zip(&self.successor[depth][j])
                        .map(|((a, b), c)| a * b * c)
                        .sum::<f32>()
                });
                self.unary[depth][j] + pair
            })
            .collect()
    }

    /// The greedy chain from `anchor`: at each position the best-scored candidate after the
    /// token chosen before it (the first of equal scores).
    pub fn greedy(&self, anchor: u32) -> Vec<u32> {
        let mut token = anchor;
        (0..self.unary.len())
            .map(|depth| {
                let scores = self.scores(depth, token);
                let mut best = 0;
                for (j, &s) in scores.iter().enumerate() {
                    if s > scores[best] {
                        best = j;
                    }
                }
                token = self.candidates[depth][best];
                token
            })
            .collect()
    }

    /// The `width` likeliest candidates at `depth` after a node holding `token`, with their
    /// probabilities (softmax of the selector's scores over the position's candidates).
    pub fn children(&self, depth: usize, token: u32, width: usize) -> Vec<(u32, f32)> {
        let scores = self.scores(depth, token);
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let total: f32 = scores.iter().map(|s| (s - max).exp()).sum();
        let mut out: Vec<(u32, f32)> = self.candidates[depth]
            .iter()
            .zip(&scores)
            .map(|(&t, s)| (t, (s - max).exp() / total))
            .collect();
        out.sort_by(|a, b| b.1.total_cmp(&a.1));
        out.truncate(width.max(1));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_convolution_is_causal_within_each_block_and_the_identity_at_init() {
        let cpu = Device::Cpu;
        let (h, k, g, block) = (4, 3, 2, 3);
        let x = Tensor::arange(1f64, 25.0, &cpu)
            .unwrap()
            .reshape((6, h))
            .unwrap();
        let base: Vec<f32> = initial("l.base_kernel", &[2, k, h]).unwrap();
        let base = Tensor::from_vec(base, (2, k, h), &cpu)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        let zero = Tensor::zeros((6, k, g), DType::F64, &cpu).unwrap();
        let same = convolve(&x, &zero, &base.get(0).unwrap(), block).unwrap();
        assert_eq!(same.to_vec2::<f64>().unwrap(), x.to_vec2::<f64>().unwrap());
        // A kernel of ones at every offset sums the row and the two before it in its block.
        let ones = Tensor::ones((k, h), DType::F64, &cpu).unwrap();
        let sum = convolve(&x, &zero, &ones, block).unwrap();
        let rows = x.to_vec2::<f64>().unwrap();
        let got = sum.to_vec2::<f64>().unwrap();
        for t in 0..6 {
            let start = t / block * block;
            for c in 0..h {
                let want: f64 = (start.max(t.saturating_sub(k - 1))..=t)
                    .map(|s| rows[s][c])
                    .sum();
                assert_eq!(got[t][c], want, "row {t} channel {c}");
            }
        }
        // The dynamic part scales each group: group 1 (channels 2, 3) of row 4 by 2 at offset 1.
        let mut d = vec![0f64; 6 * k * g];
        d[4 * k * g + g + 1] = 2.0;
        let d = Tensor::from_vec(d, (6, k, g), &cpu).unwrap();
        let out = convolve(&x, &d, &base.get(0).unwrap(), block)
            .unwrap()
            .to_vec2::<f64>()
            .unwrap();
        assert_eq!(
            out[4],
            vec![
                rows[4][0],
                rows[4][1],
                rows[4][2] + 2.0 * rows[3][2],
                rows[4][3] + 2.0 * rows[3][3]
            ]
        );
        // Rows that are not whole blocks are refused.
        assert!(convolve(&x, &zero, &ones, 4).is_err());
    }

    /// A tree's likeliest child after each node, followed from the anchor, is the chain the
    /// selector picks greedily: both score a candidate after its predecessor the same way.
    #[test]
    fn the_trees_best_children_are_the_selectors_chain() {
        let cpu = Device::Cpu;
        let mut init = crate::nn::drafter::Init::new(4);
        let (n, h, v, r) = (5, 8, 30, 4);
        let config = Dflash2Config {
            conv_kernel_size: 2,
            conv_group_size: 4,
            selector_rank: r,
            selector_top_k: 6,
        };
        let weights: std::collections::HashMap<&str, Tensor> = [
            (
                PREDECESSOR,
                init.normal(&[v, r], 1.0, DType::F32, &cpu).unwrap(),
            ),
            (
                SUCCESSOR,
                init.normal(&[v, r], 1.0, DType::F32, &cpu).unwrap(),
            ),
            (
                HIDDEN_PROJECTION,
                init.normal(&[r, h], 1.0, DType::F32, &cpu).unwrap(),
            ),
        ]
        .into_iter()
        .collect();
        let w = |name: &str| weights[name].clone();
        let hidden = init.normal(&[n, h], 1.0, DType::F32, &cpu).unwrap();
        let logits = init.normal(&[n, v], 2.0, DType::F32, &cpu).unwrap();
        let chain = select(&hidden, &logits, 7, &config, &w).unwrap();
        let scorer = Scorer::new(&hidden, &logits, 7, &config, &w).unwrap();
        let mut token = 7;
        let mut followed = Vec::new();
        for depth in 0..n {
            let children = scorer.children(depth, token, 3);
            assert_eq!(children.len(), 3);
            assert!(children.windows(2).all(|p| p[0].1 >= p[1].1));
            token = children[0].0;
            followed.push(token);
        }
        assert_eq!(followed, chain);
        // The selector changes the order somewhere, or this would test nothing.
        let argmax: Vec<u32> = logits.argmax(1).unwrap().to_vec1().unwrap();
        assert_ne!(chain, argmax);
    }

    #[test]
    fn top_k_takes_the_largest_in_order() {
        let l = Tensor::new(&[[0.1f32, 3.0, -1.0, 2.0, 2.5]], &Device::Cpu).unwrap();
        let t: Vec<Vec<u32>> = top_k(&l, 3).unwrap().to_vec2().unwrap();
        assert_eq!(t, vec![vec![1, 4, 3]]);
    }

    #[test]
    fn greedy_selection_follows_the_chosen_predecessor() {
        // Two positions, two candidates each, rank 1. Position 0: unary prefers token 5, but
        // after the anchor (1) the pair term favours 6; position 1 then scores with 6's row.
        let scorer = Scorer {
            unary: vec![vec![1.0, 0.5], vec![0.0, 0.1]],
            candidates: vec![vec![5, 6], vec![7, 8]],
            projected: vec![vec![1.0], vec![1.0]],
            successor: vec![vec![vec![0.0], vec![1.0]], vec![vec![1.0], vec![0.0]]],
            predecessor: [(1, vec![1.0]), (5, vec![0.0]), (6, vec![-1.0])]
                .into_iter()
                .collect(),
        };
        // Position 0: 1.0 vs 0.5 + 1 = 1.5: token 6. Position 1 after 6 (row -1): 0 - 1 vs 0.1.
        assert_eq!(scorer.greedy(1), vec![6, 8]);
        // The tree's children after the anchor, likeliest first.
        let children = scorer.children(0, 1, 2);
        assert_eq!((children[0].0, children[1].0), (6, 5));
        assert!((children[0].1 + children[1].1 - 1.0).abs() < 1e-6);
    }
}
