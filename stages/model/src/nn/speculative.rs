//! Speculative decoding with the frozen target (../shared/DFLASH.md, "Inference"): prefill the
//! prompt, capturing the taps; then rounds of propose (the drafter's one non-causal pass over
//! `[last token, MASK x (B-1)]`, greedy; or a prompt-lookup n-gram; or nothing, which is plain
//! autoregressive decoding through the same code), verify the proposal in one target pass,
//! commit the longest agreeing prefix plus one token from the target, crop the KV cache.
//!
//! Greedy verification (T = 0) commits exactly the tokens plain greedy decoding would; sampled
//! verification (T > 0) accepts a proposed token with the target's probability of it and
//! otherwise samples from the target's distribution with that token removed, which leaves the
//! output distributed as the target's own sampling.

use std::time::Instant;

use candle_core::{D, DType, Tensor};
use rand::{Rng, SeedableRng};

use super::Result;
use super::drafter::{ContextKv, Drafter};
use super::target::{KvCache, Target};

/// What proposes tokens each round.
#[derive(Clone, Copy)]
pub enum Proposer<'a> {
    /// Nothing: one token per target pass (the autoregressive baseline).
    Autoregressive,
    /// Prompt lookup: the tokens that followed the latest earlier occurrence of the history's
    /// last `n` (down to 1) tokens.
    Ngram {
        /// The longest suffix matched.
        n: usize,
    },
    /// A DFlash drafter, fed the target's taps.
    Drafter(&'a Drafter),
    /// A DFlash drafter whose block is verified as a tree ([`draft_tree`]): up to `budget`
    /// nodes from each position's `width` likeliest tokens, the likeliest continuations first,
    /// checked in one target pass; the longest path the target agrees with is committed.
    DrafterTree {
        /// The drafter.
        drafter: &'a Drafter,
        /// Candidates per position (at most [`super::fused::TOP_K_MAX`]; more are not used).
        width: usize,
        /// Nodes per tree, the root (the round's first token) included.
        budget: usize,
        /// Above 0: prompt lookup's continuations (matching the history's last `lookup`
        /// tokens, down to 1; up to [`LOOKUP_PATHS`], [`ngram_lookups`]) grafted onto the tree
        /// as more paths ([`Tree::graft`]), within the budget. The two guess differently: the drafter what the target tends to say, the
        /// lookup what it is copying (a function's signature, the answer a second turn
        /// revises), and the target's pass checks both at once.
        lookup: usize,
    },
    /// A continuation known in advance, proposed as it is: given the target's own greedy output
    /// it is a perfect drafter (tau = B), which checks the loop's bookkeeping.
    Oracle(&'a [u32]),
}

/// How to decode.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Tokens per round at most: one verified token plus `block_size - 1` proposed.
    pub block_size: usize,
    /// The most output tokens.
    pub max_new_tokens: usize,
    /// 0: greedy.
    pub temperature: f64,
    /// Seeds sampling (unused when greedy).
    pub seed: u64,
    /// Token ids that end the output (committed and counted, not returned).
    pub stop: Vec<u32>,
    /// Time each phase of a round ([`Decoded::phase_seconds`]), the device synchronised at
    /// every phase's end: slower than an unprofiled decode (each synchronisation drains the
    /// queue), for finding where a round's time goes, not for speeds.
    pub profile: bool,
}

/// One decoded prompt.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decoded {
    /// The output tokens, without the stop token.
    pub tokens: Vec<u32>,
    /// Whether a stop token ended it.
    pub stopped: bool,
    /// Verification rounds (the first token comes from the prefill, not a round).
    pub rounds: u64,
    /// Tokens the rounds committed (accepted proposals plus the target's token each).
    pub committed: u64,
    /// Per proposal position k = 1..B-1: rounds in which the proposal at k was accepted.
    pub accepted_at: Vec<u64>,
    /// Seconds in the prefill (and the first token).
    pub prefill_seconds: f64,
    /// Seconds in the rounds.
    pub decode_seconds: f64,
    /// Of `decode_seconds`, those spent proposing: the drafter's pass (and, for a tree,
    /// building it) or prompt lookup's search, up to the proposals on the host; the rest is the
    /// target's verification pass and the bookkeeping after it. Both ends of a proposal wait
    /// for the device (its tokens are read back), so on a GPU the split is real, not queued.
    pub propose_seconds: f64,
    /// With [`Settings::profile`]: seconds per phase of the rounds, in the order first met
    /// (`drafter context`, `drafter pass`, `candidates`, `tree`, `lookup`, `target pass`,
    /// `walk`, `verify`, `cache`, `taps`); empty otherwise.
    pub phase_seconds: Vec<(&'static str, f64)>,
}

/// The profile's clock ([`Settings::profile`]): each lap waits for the device, then adds the
/// time since the last lap to its phase. Off, a lap costs nothing and waits for nothing.
struct Laps {
    device: Option<candle_core::Device>,
    last: Instant,
    seconds: Vec<(&'static str, f64)>,
}

impl Laps {
    fn new(profile: bool, device: &candle_core::Device) -> Self {
        Self {
            device: profile.then(|| device.clone()),
            last: Instant::now(),
            seconds: Vec::new(),
        }
    }

    /// A round starts: what came before it is no phase.
    fn start(&mut self) {
        self.last = Instant::now();
    }

    fn lap(&mut self, phase: &'static str) -> Result<()> {
        let Some(device) = &self.device else {
            return Ok(());
        };
        device.synchronize()?;
        let now = Instant::now();
        let dt = now.duration_since(self.last).as_secs_f64();
        match self.seconds.iter_mut().find(|(p, _)| *p == phase) {
            Some((_, s)) => *s += dt,
            None => self.seconds.push((phase, dt)),
        }
        self.last = now;
        Ok(())
    }
}

impl Decoded {
    /// Mean tokens committed per round.
    pub fn tau(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            self.committed as f64 / self.rounds as f64
        }
    }
}

/// The target's choice at each row of `logits` `[n, V]`: argmax when greedy; else a
/// verification against `proposed` (see the module docs). Returns how many proposals were
/// accepted and the target's token after them.
fn verify(
    logits: &Tensor,
    proposed: &[u32],
    temperature: f64,
    rng: &mut rand_chacha::ChaCha8Rng,
) -> Result<(usize, u32)> {
    if temperature <= 0.0 {
        let choice: Vec<u32> = logits.argmax(D::Minus1)?.to_vec1()?;
        let k = proposed
            .iter()
            .zip(&choice)
            .take_while(|(p, c)| p == c)
            .count();
        return Ok((k, choice[k]));
    }
    let probs = candle_nn::ops::softmax_last_dim(&(logits.to_dtype(DType::F32)? / temperature)?)?;
    let rows: Vec<Vec<f32>> = probs.to_vec2()?;
    for (j, &d) in proposed.iter().enumerate() {
        let p = &rows[j];
        if rng.random::<f32>() < p[d as usize] {
            continue;
        }
        // Rejected: the residual max(p - onehot(d), 0), renormalised, is p without d.
        let mut residual = p.clone();
        residual[d as usize] = 0.0;
        return Ok((j, sample(&residual, rng)));
    }
    Ok((proposed.len(), sample(&rows[proposed.len()], rng)))
}

/// A draw from unnormalised weights.
fn sample(weights: &[f32], rng: &mut rand_chacha::ChaCha8Rng) -> u32 {
    let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
    let mut u = rng.random::<f64>() * total;
    for (i, &w) in weights.iter().enumerate() {
        u -= f64::from(w);
        if u <= 0.0 && w > 0.0 {
            return i as u32;
        }
    }
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32
}

/// Continuations prompt lookup grafts onto a tree: three distinct ones (from the latest
/// matches) took tau from 4.56 / 3.79 / 4.25 with one to 4.61 / 3.88 / 4.37 (HumanEval / GSM8K /
/// MT-Bench, 64 nodes, README "The seventh run").
const LOOKUP_PATHS: usize = 3;

/// `paths` cut to fit a tree of `budget` nodes beside its root: the later ones first.
fn within_budget(mut paths: Vec<Vec<u32>>, budget: usize) -> Vec<Vec<u32>> {
    let mut left = budget.saturating_sub(1);
    for path in &mut paths {
        path.truncate(left);
        left -= path.len();
    }
    paths.retain(|p| !p.is_empty());
    paths
}

/// Up to `paths` distinct continuations of the history's last `n` tokens (down to 1), from
/// the latest match back, the longer matches first: what [`ngram_lookup`] proposes, then the
/// next likeliest copies.
pub fn ngram_lookups(history: &[u32], n: usize, max: usize, paths: usize) -> Vec<Vec<u32>> {
    let len = history.len();
    let mut found: Vec<Vec<u32>> = Vec::new();
    for size in (1..=n.min(len.saturating_sub(1))).rev() {
        let suffix = &history[len - size..];
        for start in (0..len - size).rev() {
            if found.len() >= paths {
                return found;
            }
            if &history[start..start + size] != suffix {
                continue;
            }
            let from = start + size;
            let copy = &history[from..(from + max).min(len)];
            if !copy.is_empty() && !found.iter().any(|f| f == copy) {
                found.push(copy.to_vec());
            }
        }
    }
    found
}

/// Prompt lookup: up to `max` tokens that followed the latest earlier occurrence of the
/// history's last `n`, `n - 1`, ... 1 tokens.
pub fn ngram_lookup(history: &[u32], n: usize, max: usize) -> Vec<u32> {
    ngram_lookups(history, n, max, 1).pop().unwrap_or_default()
}

/// Decode `prompt` with `target`, proposing with `proposer`.
pub fn decode(
    target: &Target,
    proposer: &Proposer<'_>,
    prompt: &[u32],
    s: &Settings,
) -> Result<Decoded> {
    // The drafter's passes on its weights detached from their variables (`Drafter::frozen`):
    // no backward graph, and the decoding forms of its ops.
    let frozen = match proposer {
        Proposer::Drafter(d) | Proposer::DrafterTree { drafter: d, .. } => Some(d.frozen()),
        _ => None,
    };
    let proposer = &match (*proposer, &frozen) {
        (Proposer::Drafter(_), Some(f)) => Proposer::Drafter(f),
        (
            Proposer::DrafterTree {
                width,
                budget,
                lookup,
                ..
            },
            Some(f),
        ) => Proposer::DrafterTree {
            drafter: f,
            width,
            budget,
            lookup,
        },
        (p, _) => p,
    };
    let block = s.block_size.max(1);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(s.seed);
    let taps: &[usize] = match proposer {
        Proposer::Drafter(d) | Proposer::DrafterTree { drafter: d, .. } => &d.config.target_layers,
        _ => &[],
    };
    let mut out = Decoded {
        accepted_at: vec![0; block - 1],
        ..Decoded::default()
    };
    if s.max_new_tokens == 0 {
        return Ok(out);
    }
    let started = Instant::now();
    let mut cache = KvCache::default();
    let (logits, mut pending) = target.extend(prompt, &mut cache, taps)?;
    let last = logits.narrow(0, prompt.len() - 1, 1)?;
    let (_, first) = verify(&last, &[], s.temperature, &mut rng)?;
    let mut tokens = vec![first];
    let mut drafter_ctx: Option<ContextKv> = None;
    out.prefill_seconds = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let mut stopped = s.stop.contains(&first);
    let mut laps = Laps::new(s.profile, logits.device());
    while !stopped && tokens.len() < s.max_new_tokens {
        let anchor = *tokens.last().expect("one token");
        let at = prompt.len() + tokens.len() - 1;
        let round = Instant::now();
        laps.start();
        // The round commits at most the proposals plus one.
        let room = (s.max_new_tokens - tokens.len()).min(block) - 1;
        // This round's accepted proposals and the target's token after them.
        let (accepted, next): (Vec<u32>, u32) = if let Proposer::DrafterTree {
            drafter: d,
            width,
            budget,
            lookup,
        } = proposer
        {
            let ctx = extend_context(target, d, &mut pending, &mut drafter_ctx)?;
            laps.lap("drafter context")?;
            // Prompt lookup's guess first: the drafter's tree takes the rest of the budget.
            let copied: Vec<Vec<u32>> = if *lookup > 0 && room > 0 {
                let history: Vec<u32> = prompt.iter().chain(&tokens).copied().collect();
                within_budget(
                    ngram_lookups(&history, *lookup, room, LOOKUP_PATHS),
                    *budget,
                )
            } else {
                Vec::new()
            };
            let budget = &budget
                .saturating_sub(copied.iter().map(Vec::len).sum())
                .max(1);
            let mut tree = if room == 0 {
                Tree::root(anchor)
            } else {
                match &d.config.dflash2 {
                    None => {
                        let candidates =
                            propose_top(target, d, ctx, anchor, at, room, *width, &mut laps)?;
                        draft_tree(anchor, &candidates, *budget)
                    }
                    // DFlash 2: each node's children are the selector's choices after its token.
                    Some(sel) => {
                        let (hidden, logits) = block_logits(target, d, ctx, anchor, at)?;
                        let n = room.min(hidden.dim(0)?);
                        let scorer = super::dflash2::Scorer::new(
                            &hidden.narrow(0, 0, n)?,
                            &logits.narrow(0, 0, n)?,
                            anchor,
                            sel,
                            &|name| d.w(name).clone(),
                        )?;
                        draft_tree_by(anchor, n, *budget, &|depth, token| {
                            scorer.children(depth, token, *width)
                        })
                    }
                }
            };
            for path in &copied {
                tree.graft(path);
            }
            laps.lap("tree")?;
            out.propose_seconds += round.elapsed().as_secs_f64();
            let (logits, tapped) =
                target.extend_tree(&tree.tokens, &tree.parents, &mut cache, taps)?;
            laps.lap("target pass")?;
            let (path, next) = walk(&tree, &logits, s.temperature, &mut rng)?;
            laps.lap("walk")?;
            cache.keep_path(at, &path)?;
            laps.lap("cache")?;
            let rows = Tensor::new(
                path.iter()
                    .map(|&i| i as u32)
                    .collect::<Vec<_>>()
                    .as_slice(),
                logits.device(),
            )?;
            pending = tapped.map(|t| t.index_select(&rows, 0)).transpose()?;
            laps.lap("taps")?;
            (path[1..].iter().map(|&i| tree.tokens[i]).collect(), next)
        } else {
            let proposed: Vec<u32> = match proposer {
                Proposer::Autoregressive => Vec::new(),
                _ if room == 0 => Vec::new(),
                Proposer::Ngram { n } => {
                    let history: Vec<u32> = prompt.iter().chain(&tokens).copied().collect();
                    let found = ngram_lookup(&history, *n, room);
                    laps.lap("lookup")?;
                    found
                }
                Proposer::Oracle(known) => known
                    .iter()
                    .skip(tokens.len())
                    .take(room)
                    .copied()
                    .collect(),
                Proposer::DrafterTree { .. } => unreachable!("handled above"),
                Proposer::Drafter(d) => {
                    let ctx = extend_context(target, d, &mut pending, &mut drafter_ctx)?;
                    laps.lap("drafter context")?;
                    let best = propose(target, d, ctx, anchor, at, room)?;
                    laps.lap("drafter pass")?;
                    best
                }
            };
            out.propose_seconds += round.elapsed().as_secs_f64();
            let ids: Vec<u32> = std::iter::once(anchor).chain(proposed.clone()).collect();
            let (logits, tapped) = target.extend(&ids, &mut cache, taps)?;
            laps.lap("target pass")?;
            let (k, next) = verify(&logits, &proposed, s.temperature, &mut rng)?;
            laps.lap("verify")?;
            cache.truncate(at + k + 1)?;
            laps.lap("cache")?;
            pending = tapped.map(|t| t.narrow(0, 0, k + 1)).transpose()?;
            laps.lap("taps")?;
            (proposed[..k].to_vec(), next)
        };
        out.rounds += 1;
        for hit in &mut out.accepted_at[..accepted.len()] {
            *hit += 1;
        }
        for t in accepted.into_iter().chain([next]) {
            out.committed += 1;
            if s.stop.contains(&t) {
                stopped = true;
                break;
            }
            tokens.push(t);
        }
    }
    out.decode_seconds = started.elapsed().as_secs_f64();
    out.phase_seconds = laps.seconds;
    if stopped {
        // The stop token is not output.
        if tokens.last().is_some_and(|t| s.stop.contains(t)) {
            tokens.pop();
        }
    }
    out.tokens = tokens;
    out.stopped = stopped;
    Ok(out)
}

/// Hand the taps of the tokens accepted last round (`pending`) to the drafter's cached context
/// (its keys and values are computed once per accepted token); the context as it now is.
fn extend_context<'c>(
    target: &Target,
    d: &Drafter,
    pending: &mut Option<Tensor>,
    drafter_ctx: &'c mut Option<ContextKv>,
) -> Result<&'c ContextKv> {
    let ctx = pending.take().expect("the taps of the accepted tokens");
    let first_pos = drafter_ctx.as_ref().map_or(0, ContextKv::len) as u32;
    let positions: Vec<u32> = (first_pos..first_pos + ctx.dim(0)? as u32).collect();
    let more = d.context_kv(&ctx.to_dtype(target.dtype)?, &positions)?;
    match drafter_ctx.as_mut() {
        Some(c) => c.extend(more)?,
        None => *drafter_ctx = Some(more),
    }
    Ok(drafter_ctx.as_ref().expect("set"))
}

/// The drafter's final hidden states `[B - 1, H]` and logits `[B - 1, V]` at the block
/// positions after `anchor` (at position `at`): one non-causal pass over
/// `[anchor, MASK x (B - 1)]`, which sees all of the context.
fn block_logits(
    target: &Target,
    d: &Drafter,
    ctx: &ContextKv,
    anchor: u32,
    at: usize,
) -> Result<(Tensor, Tensor)> {
    let b = d.config.block_size;
    let device = target.embed.device();
    let ids: Vec<u32> = std::iter::once(anchor)
        .chain(std::iter::repeat_n(d.config.mask_token_id, b - 1))
        .collect();
    let embedded = target.embed(&Tensor::new(ids.as_slice(), device)?)?;
    let positions: Vec<u32> = (at as u32..(at + b) as u32).collect();
    let mask = super::ops::BlockMask::new(vec![ctx.len() as u32], ctx.len(), b);
    let hidden = d.forward_block(ctx, &embedded, &positions, &mask)?;
    let hidden = hidden.narrow(0, 1, b - 1)?;
    let logits =
        super::ops::Linear::Dense(target.lm_head.to_dtype(hidden.dtype())?).forward(&hidden)?;
    Ok((hidden, logits))
}

/// The drafter's greedy proposals for the `room` positions after `anchor` (at position `at`).
fn propose(
    target: &Target,
    d: &Drafter,
    ctx: &ContextKv,
    anchor: u32,
    at: usize,
    room: usize,
) -> Result<Vec<u32>> {
    let (hidden, logits) = block_logits(target, d, ctx, anchor, at)?;
    // DFlash 2: the candidate selector picks each position's token, left to right.
    let mut best: Vec<u32> = match &d.config.dflash2 {
        Some(sel) => super::dflash2::select(&hidden, &logits, anchor, sel, &|n| d.w(n).clone())?,
        None => logits.argmax(D::Minus1)?.to_vec1()?,
    };
    best.truncate(room);
    Ok(best)
}

/// The drafter's `width` likeliest tokens and their probabilities at each of the `room`
/// positions after `anchor`, likeliest first.
#[allow(clippy::too_many_arguments)]
fn propose_top(
    target: &Target,
    d: &Drafter,
    ctx: &ContextKv,
    anchor: u32,
    at: usize,
    room: usize,
    width: usize,
    laps: &mut Laps,
) -> Result<Vec<Vec<(u32, f32)>>> {
    let (_, logits) = block_logits(target, d, ctx, anchor, at)?;
    laps.lap("drafter pass")?;
    let logits = logits
        .narrow(0, 0, room.min(logits.dim(0)?))?
        .to_dtype(DType::F32)?;
    let probs = candle_nn::ops::softmax_last_dim(&logits)?;
    // The candidates picked where the logits are, in one top-k pass: only `rows x w` numbers
    // cross to the host. Copying `rows x vocab` probabilities and selecting on the host made a
    // tree round's proposing 4.3 ms on an H100 where the chain's, whose argmax runs on the
    // device, took 2.3.
    let w = width.clamp(1, logits.dim(1)?.min(super::fused::TOP_K_MAX));
    let picked = super::fused::top_k(&logits, w)?;
    // Tokens and their probabilities side by side, one copy (token ids below 2^24 are exact
    // in f32).
    let both: Vec<Vec<f32>> = Tensor::cat(
        &[&picked.to_dtype(DType::F32)?, &probs.gather(&picked, 1)?],
        1,
    )?
    .to_vec2()?;
    laps.lap("candidates")?;
    Ok(both
        .iter()
        .map(|row| {
            let (tokens, p) = row.split_at(w);
            tokens
                .iter()
                .map(|&t| t as u32)
                .zip(p.iter().copied())
                .collect()
        })
        .collect())
}

/// A tree of drafted tokens: node 0 the root (the round's first token), every other node after
/// its parent.
#[derive(Clone, Debug, PartialEq)]
pub struct Tree {
    /// Each node's token.
    pub tokens: Vec<u32>,
    /// Each node's parent (the root's is `usize::MAX`).
    pub parents: Vec<usize>,
}

impl Tree {
    /// Add `path` below the root: down the nodes that already hold its tokens, then as new
    /// nodes (each after its parent, as the target's tree pass needs).
    pub fn graft(&mut self, path: &[u32]) {
        let mut node = 0;
        for &t in path {
            node = match (1..self.tokens.len())
                .find(|&c| self.parents[c] == node && self.tokens[c] == t)
            {
                Some(c) => c,
                None => {
                    self.tokens.push(t);
                    self.parents.push(node);
                    self.tokens.len() - 1
                }
            };
        }
    }

    fn root(token: u32) -> Self {
        Self {
            tokens: vec![token],
            parents: vec![usize::MAX],
        }
    }
}

/// Up to `budget` nodes (the root included) from per-position candidates `top[d]` (depth d + 1):
/// best first by the product of the drafter's probabilities along the path, so the tree holds
/// the likeliest continuations of every length (a node's children are its depth's
/// candidates: DFlash drafts every position of a block at once, none conditioned on another).
pub fn draft_tree(root: u32, top: &[Vec<(u32, f32)>], budget: usize) -> Tree {
    draft_tree_by(root, top.len(), budget, &|depth, _| top[depth].clone())
}

/// [`draft_tree`] where a node's children depend on its token: `children(d, token)` gives the
/// candidates at depth d + 1 after a node holding `token` (the root's is the round's first
/// token), with their probabilities (DFlash 2's selector scores each candidate after its
/// predecessor).
pub fn draft_tree_by(
    root: u32,
    depths: usize,
    budget: usize,
    children: &dyn Fn(usize, u32) -> Vec<(u32, f32)>,
) -> Tree {
    #[derive(PartialEq)]
    struct Candidate {
        log_p: f64,
        parent: usize,
        depth: usize,
        rank: usize,
        token: u32,
    }
    impl Eq for Candidate {}
    impl PartialOrd for Candidate {
        fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(o))
        }
    }
    impl Ord for Candidate {
        fn cmp(&self, o: &Self) -> std::cmp::Ordering {
            // The likelier first; ties to the shallower, then the better ranked.
            self.log_p
                .total_cmp(&o.log_p)
                .then(o.depth.cmp(&self.depth))
                .then(o.rank.cmp(&self.rank))
        }
    }
    let mut tree = Tree::root(root);
    let mut heap = std::collections::BinaryHeap::new();
    let expand = |heap: &mut std::collections::BinaryHeap<Candidate>,
                  parent: usize,
                  token: u32,
                  depth: usize,
                  log_p: f64| {
        if depth < depths {
            for (rank, (t, p)) in children(depth, token).into_iter().enumerate() {
                heap.push(Candidate {
                    log_p: log_p + f64::from(p.max(1e-30)).ln(),
                    parent,
                    depth: depth + 1,
                    rank,
                    token: t,
                });
            }
        }
    };
    expand(&mut heap, 0, root, 0, 0.0);
    while tree.tokens.len() < budget.max(1) {
        let Some(c) = heap.pop() else { break };
        let node = tree.tokens.len();
        tree.tokens.push(c.token);
        tree.parents.push(c.parent);
        expand(&mut heap, node, c.token, c.depth, c.log_p);
    }
    tree
}

/// Walk `tree` with the target's `logits` at its nodes: from the root, the target's token
/// (argmax, or a draw at `temperature`) at each node leads to the child holding it; where no
/// child does, that token ends the round. The accepted path (root first) and that token.
/// Sampling keeps the target's distribution: every committed token is the target's own draw.
fn walk(
    tree: &Tree,
    logits: &Tensor,
    temperature: f64,
    rng: &mut rand_chacha::ChaCha8Rng,
) -> Result<(Vec<usize>, u32)> {
    let mut path = vec![0usize];
    // Greedy: every node's choice in one pass and one copy to the host (not one per step).
    let greedy: Option<Vec<u32>> = if temperature <= 0.0 {
        Some(logits.argmax(D::Minus1)?.to_vec1()?)
    } else {
        None
    };
    loop {
        let node = *path.last().expect("the root");
        let choice = if let Some(best) = &greedy {
            best[node]
        } else {
            let row = logits.narrow(0, node, 1)?.to_dtype(DType::F32)?;
            let probs = candle_nn::ops::softmax_last_dim(&(row / temperature)?)?;
            let p: Vec<f32> = probs.squeeze(0)?.to_vec1()?;
            sample(&p, rng)
        };
        match (1..tree.tokens.len()).find(|&c| tree.parents[c] == node && tree.tokens[c] == choice)
        {
            Some(child) => path.push(child),
            None => return Ok((path, choice)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::drafter::DrafterConfig;
    use crate::nn::drafter::tests::tiny_target;

    fn settings(block_size: usize, max_new_tokens: usize) -> Settings {
        Settings {
            block_size,
            max_new_tokens,
            temperature: 0.0,
            seed: 0,
            stop: Vec::new(),
            profile: false,
        }
    }

    #[test]
    fn a_profiled_decode_times_each_phase_of_its_rounds_and_decodes_the_same() {
        let target = tiny_target(DType::F64);
        let prompt = [3u32, 17, 5, 9, 22, 3, 17];
        let config = DrafterConfig::for_target(
            &target.config,
            1,
            vec![0, 1],
            4,
            target.config.vocab as u32 - 1,
        );
        let drafter = Drafter::init(config, 7, DType::F64, target.embed.device()).unwrap();
        let tree = Proposer::DrafterTree {
            drafter: &drafter,
            width: 3,
            budget: 10,
            lookup: 3,
        };
        let cases: [(&Proposer, &[&str]); 4] = [
            (
                &Proposer::Autoregressive,
                &["target pass", "verify", "cache", "taps"],
            ),
            (
                &Proposer::Ngram { n: 3 },
                &["lookup", "target pass", "verify", "cache", "taps"],
            ),
            (
                &Proposer::Drafter(&drafter),
                &[
                    "drafter context",
                    "drafter pass",
                    "target pass",
                    "verify",
                    "cache",
                    "taps",
                ],
            ),
            (
                &tree,
                &[
                    "drafter context",
                    "drafter pass",
                    "candidates",
                    "tree",
                    "target pass",
                    "walk",
                    "cache",
                    "taps",
                ],
            ),
        ];
        for (p, phases) in cases {
            let plain = decode(&target, p, &prompt, &settings(4, 12)).unwrap();
            assert!(plain.phase_seconds.is_empty(), "unasked, nothing is timed");
            let mut s = settings(4, 12);
            s.profile = true;
            let timed = decode(&target, p, &prompt, &s).unwrap();
            assert_eq!(timed.tokens, plain.tokens, "profiling changed the output");
            let names: Vec<&str> = timed.phase_seconds.iter().map(|(n, _)| *n).collect();
            assert_eq!(names, phases);
            let sum: f64 = timed.phase_seconds.iter().map(|(_, s)| s).sum();
            assert!(
                sum <= timed.decode_seconds,
                "phases {sum} s in rounds of {} s",
                timed.decode_seconds
            );
        }
    }

    #[test]
    fn a_grafted_path_reuses_the_nodes_that_hold_its_tokens() {
        // Root 5; children 7 and 8; 7's child 9.
        let mut tree = Tree {
            tokens: vec![5, 7, 8, 9],
            parents: vec![usize::MAX, 0, 0, 1],
        };
        tree.graft(&[7, 9, 4, 4]);
        assert_eq!(tree.tokens, [5, 7, 8, 9, 4, 4]);
        assert_eq!(tree.parents, [usize::MAX, 0, 0, 1, 3, 4]);
        // A path the tree already holds adds nothing; a new first token starts a branch.
        tree.graft(&[8]);
        tree.graft(&[6, 7]);
        assert_eq!(tree.tokens, [5, 7, 8, 9, 4, 4, 6, 7]);
        assert_eq!(tree.parents, [usize::MAX, 0, 0, 1, 3, 4, 0, 6]);
        tree.graft(&[]);
        assert_eq!(tree.tokens.len(), 8);
    }

    /// Where the target's output repeats itself, prompt lookup's path in the tree is accepted
    /// where an untrained drafter's are not: more tokens per pass, the same output.
    #[test]
    fn prompt_lookup_grafted_onto_a_tree_commits_what_the_output_repeats() {
        let target = tiny_target(DType::F64);
        let config = DrafterConfig::for_target(
            &target.config,
            1,
            vec![0, 1],
            4,
            target.config.vocab as u32 - 1,
        );
        let untrained = Drafter::init(config, 7, DType::F64, target.embed.device()).unwrap();
        let tree = |lookup| Proposer::DrafterTree {
            drafter: &untrained,
            width: 2,
            budget: 8,
            lookup,
        };
        // The first prompt (of a fixed sequence) whose greedy output repeats enough for prompt
        // lookup to pay: a small random model's outputs fall into loops.
        let (prompt, lookup_tau) = (0u32..64)
            .map(|i| -> Vec<u32> { (0..6).map(|j| (i * 11 + j * 7 + 1) % 39).collect() })
            .find_map(|p| {
                let ngram =
                    decode(&target, &Proposer::Ngram { n: 3 }, &p, &settings(4, 40)).unwrap();
                (ngram.tau() > 1.5).then(|| (p, ngram.tau()))
            })
            .expect("a prompt whose output repeats");
        let plain = decode(&target, &tree(0), &prompt, &settings(4, 40)).unwrap();
        let grafted = decode(&target, &tree(3), &prompt, &settings(4, 40)).unwrap();
        assert_eq!(grafted.tokens, plain.tokens, "the graft changed the output");
        assert!(
            grafted.tau() > plain.tau(),
            "tau with lookup {:.2} (lookup alone {lookup_tau:.2}), without {:.2}",
            grafted.tau(),
            plain.tau()
        );
    }

    #[test]
    fn prompt_lookup_continues_the_latest_match() {
        // Several: the latest match's first, then earlier ones, distinct, longer matches first.
        let h = [1, 2, 3, 9, 1, 2, 3, 7, 4, 2, 3, 7, 1, 2, 3];
        assert_eq!(
            ngram_lookups(&h, 3, 2, 3),
            vec![vec![7, 4], vec![9, 1], vec![7, 1]]
        );
        assert_eq!(ngram_lookups(&h, 3, 2, 1), vec![ngram_lookup(&h, 3, 2)]);
        // A tree of 4 nodes holds the root and 3 copied tokens: the later paths are cut.
        assert_eq!(
            within_budget(ngram_lookups(&h, 3, 2, 3), 4),
            vec![vec![7, 4], vec![9]]
        );
        assert!(within_budget(vec![vec![1, 2]], 1).is_empty());
        assert!(ngram_lookups(&[1, 2, 3], 3, 4, 3).is_empty());
        assert_eq!(
            ngram_lookup(&[1, 2, 3, 9, 1, 2, 3, 7, 1, 2], 3, 2),
            vec![3, 7]
        );
        assert_eq!(ngram_lookup(&[5, 6, 5], 3, 4), vec![6, 5]);
        assert!(ngram_lookup(&[1, 2, 3], 3, 4).is_empty());
    }

    #[test]
    fn greedy_speculation_is_lossless_and_an_oracle_commits_whole_blocks() {
        let target = tiny_target(DType::F64);
        let prompt = [3u32, 17, 5, 9, 22, 3, 17];
        let ar = decode(
            &target,
            &Proposer::Autoregressive,
            &prompt,
            &settings(4, 25),
        )
        .unwrap();
        assert_eq!(ar.tokens.len(), 25);
        assert_eq!(ar.rounds, 24);
        assert!((ar.tau() - 1.0).abs() < 1e-12);
        let config = DrafterConfig::for_target(
            &target.config,
            1,
            vec![0, 1],
            4,
            target.config.vocab as u32 - 1,
        );
        let drafter = Drafter::init(config.clone(), 7, DType::F64, target.embed.device()).unwrap();
        let dflash2 = Drafter::init(
            config.with_dflash2(crate::nn::dflash2::Dflash2Config {
                conv_kernel_size: 3,
                conv_group_size: 4,
                selector_rank: 4,
                selector_top_k: 5,
            }),
            7,
            DType::F64,
            target.embed.device(),
        )
        .unwrap();
        for p in [
            Proposer::Ngram { n: 3 },
            Proposer::Drafter(&drafter),
            Proposer::Drafter(&dflash2),
            Proposer::DrafterTree {
                drafter: &dflash2,
                width: 3,
                budget: 10,
                lookup: 0,
            },
            Proposer::DrafterTree {
                drafter: &dflash2,
                width: 3,
                budget: 10,
                lookup: 3,
            },
            Proposer::Oracle(&ar.tokens),
            Proposer::DrafterTree {
                drafter: &drafter,
                width: 3,
                budget: 10,
                lookup: 0,
            },
            Proposer::DrafterTree {
                drafter: &drafter,
                width: 3,
                budget: 10,
                lookup: 3,
            },
        ] {
            let sp = decode(&target, &p, &prompt, &settings(4, 25)).unwrap();
            assert_eq!(sp.tokens, ar.tokens, "speculation changed the output");
            assert_eq!(sp.committed, 24);
        }
        // 24 tokens after the first, 4 per round.
        let oracle = decode(
            &target,
            &Proposer::Oracle(&ar.tokens),
            &prompt,
            &settings(4, 25),
        )
        .unwrap();
        assert_eq!(oracle.rounds, 6);
        assert!((oracle.tau() - 4.0).abs() < 1e-12);
        assert_eq!(oracle.accepted_at, vec![6, 6, 6]);
        let untrained = decode(
            &target,
            &Proposer::Drafter(&drafter),
            &prompt,
            &settings(4, 25),
        )
        .unwrap();
        assert!(
            untrained.tau() < 1.5,
            "an untrained drafter: tau {}",
            untrained.tau()
        );
    }

    #[test]
    fn sampled_verification_keeps_the_targets_distribution() {
        // The token committed at the first proposal position, over many draws: accepted with
        // the target's probability of the proposal, else drawn from the rest. Its distribution
        // must be the target's softmax whichever token is proposed.
        let logits = Tensor::new(
            &[[1.0f32, 0.2, -0.5, 2.0], [0.0, 0.0, 0.0, 0.0]],
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let want: Vec<f64> = {
            let e: Vec<f64> = [1.0f64, 0.2, -0.5, 2.0].iter().map(|x| x.exp()).collect();
            let t: f64 = e.iter().sum();
            e.iter().map(|x| x / t).collect()
        };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
        for proposed in 0..4u32 {
            let mut seen = [0f64; 4];
            let draws = 20_000;
            for _ in 0..draws {
                let (k, next) = verify(&logits, &[proposed], 1.0, &mut rng).unwrap();
                let token = if k == 1 { proposed } else { next };
                seen[token as usize] += 1.0 / f64::from(draws);
            }
            let tv: f64 = seen
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .sum::<f64>()
                / 2.0;
            assert!(tv < 0.02, "proposing {proposed}: {seen:?} vs {want:?}");
        }
    }

    #[test]
    fn a_drafter_trained_on_the_targets_own_outputs_beats_an_untrained_one() {
        use crate::nn::objective::{Batch, loss};
        use crate::nn::optim::AdamW;
        let target = tiny_target(DType::F32);
        let device = target.embed.device().clone();
        let config = DrafterConfig::for_target(
            &target.config,
            1,
            vec![1, 3],
            4,
            target.config.vocab as u32 - 1,
        );
        let untrained = Drafter::init(config.clone(), 3, DType::F32, &device).unwrap();
        let trained = Drafter::init(config, 3, DType::F32, &device).unwrap();
        // The target's own greedy continuations of short random prompts.
        let prompts: Vec<Vec<u32>> = (0..24u32)
            .map(|r| (0..4).map(|i| (r * 11 + i * 5 + 1) % 38).collect())
            .collect();
        let data: Vec<(Vec<u32>, Vec<i8>)> = prompts
            .iter()
            .map(|p| {
                let out = decode(&target, &Proposer::Autoregressive, p, &settings(4, 28)).unwrap();
                let ids: Vec<u32> = p.iter().chain(&out.tokens).copied().collect();
                let mask = (0..ids.len()).map(|i| i8::from(i >= p.len())).collect();
                (ids, mask)
            })
            .collect();
        let mut adam = AdamW::new(&trained.vars, 0.0).unwrap();
        let embed = |t: &Tensor| target.embed(t);
        for step in 0..300u64 {
            let (ids, mask) = &data[step as usize % 20];
            let b =
                Batch::sample(ids, mask, 8, 4, trained.config.mask_token_id, 4.0, step).unwrap();
            let ctx = target.tapped(ids, &trained.config.target_layers).unwrap();
            let (l, _) = loss(&trained, &embed, &target.lm_head, &ctx, &b, b.weight()).unwrap();
            let grads = l.backward().unwrap();
            let g = trained.gradients(&grads);
            adam.step(&trained.vars, &g, 1e-2, 1.0).unwrap();
        }
        // Held-out prompts.
        let tau = |d: &Drafter| -> f64 {
            let (mut c, mut r) = (0, 0);
            for p in &prompts[20..] {
                let o = decode(&target, &Proposer::Drafter(d), p, &settings(4, 28)).unwrap();
                (c, r) = (c + o.committed, r + o.rounds);
            }
            c as f64 / r as f64
        };
        let (before, after) = (tau(&untrained), tau(&trained));
        assert!(
            after > before + 0.5,
            "tau untrained {before:.2}, trained {after:.2}"
        );
        // The same drafter verified as a tree of its top-3 candidates per position: the same
        // outputs, more tokens per target pass.
        let (mut c, mut r) = (0, 0);
        for p in &prompts[20..] {
            let tree = Proposer::DrafterTree {
                drafter: &trained,
                width: 3,
                budget: 16,
                lookup: 0,
            };
            let o = decode(&target, &tree, p, &settings(4, 28)).unwrap();
            let chain = decode(&target, &Proposer::Drafter(&trained), p, &settings(4, 28)).unwrap();
            assert_eq!(o.tokens, chain.tokens);
            (c, r) = (c + o.committed, r + o.rounds);
        }
        let tree = c as f64 / r as f64;
        assert!(tree > after, "tau chain {after:.2}, tree {tree:.2}");
    }

    #[test]
    fn a_draft_tree_holds_the_likeliest_paths_within_its_budget() {
        let top = vec![
            vec![(10, 0.6), (11, 0.3)],
            vec![(20, 0.9), (21, 0.05)],
            vec![(30, 0.5), (31, 0.4)],
        ];
        let t = draft_tree(7, &top, 6);
        assert_eq!(t.tokens.len(), 6);
        // Root; 10 (0.6); 20 under 10 (0.54); 11 (0.3); 30 under 20 (0.27); 20 under 11
        // (0.27 too: the shallower first).
        assert_eq!(t.tokens, vec![7, 10, 20, 11, 20, 30]);
        assert_eq!(t.parents, vec![usize::MAX, 0, 1, 0, 3, 2]);
        for (i, &p) in t.parents.iter().enumerate().skip(1) {
            assert!(p < i);
        }
        // A budget of one is the root alone; a large one stops at the last depth.
        assert_eq!(draft_tree(7, &top, 1).tokens, vec![7]);
        assert_eq!(draft_tree(7, &top, 1000).tokens.len(), 1 + 2 + 4 + 8);
    }

    #[test]
    fn sampled_tree_walks_keep_the_targets_distribution() {
        // Whatever the tree holds, the first token a round commits is the target's draw at the
        // root, and the second, when the walk goes on, its draw at that child.
        let logits = Tensor::new(
            &[
                [1.0f32, 0.2, -0.5, 2.0],
                [0.5, -1.0, 0.3, 0.0],
                [0.0; 4],
                [0.0; 4],
            ],
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let softmax = |row: [f64; 4]| -> Vec<f64> {
            let e: Vec<f64> = row.iter().map(|x| x.exp()).collect();
            let t: f64 = e.iter().sum();
            e.iter().map(|x| x / t).collect()
        };
        let (root, child) = (
            softmax([1.0, 0.2, -0.5, 2.0]),
            softmax([0.5, -1.0, 0.3, 0.0]),
        );
        // Root 9 with children 3 (node 1) and 0 (node 2); node 1 has child 2 (node 3).
        let tree = Tree {
            tokens: vec![9, 3, 0, 2],
            parents: vec![usize::MAX, 0, 0, 1],
        };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let (mut first, mut second) = ([0f64; 4], [0f64; 4]);
        let (draws, mut via_3) = (40_000, 0.0);
        for _ in 0..draws {
            let (path, next) = walk(&tree, &logits, 1.0, &mut rng).unwrap();
            let committed: Vec<u32> = path[1..]
                .iter()
                .map(|&i| tree.tokens[i])
                .chain([next])
                .collect();
            first[committed[0] as usize] += 1.0;
            if committed[0] == 3 {
                second[committed[1] as usize] += 1.0;
                via_3 += 1.0;
            }
        }
        let tv = |seen: &[f64; 4], n: f64, want: &[f64]| -> f64 {
            seen.iter()
                .zip(want)
                .map(|(a, b)| (a / n - b).abs())
                .sum::<f64>()
                / 2.0
        };
        assert!(tv(&first, f64::from(draws), &root) < 0.02, "{first:?}");
        assert!(tv(&second, via_3, &child) < 0.02, "{second:?}");
    }
}
