//! The DFlash drafter's shape, derived from its target as the reference implementation does
//! (../shared/DFLASH.md): a short stack of the target family's decoder layers at the target's
//! widths, a fusion of `n` tapped target layers, and the target's frozen embedding and LM head.
//! DFlash 2 adds convolutions and a candidate selector ([`Dflash2Config`]; `nn::dflash2`).

use serde::Serialize;

use crate::shape::ModelShape;

/// The most bytes of logits `train`'s LM head holds at a time: it runs the head's matmul and
/// the cross-entropy after it in chunks of rows this size (`nn::fused::head`), so a step's
/// `[block rows, vocab]` logits never exist in full.
pub const LM_HEAD_CHUNK_BYTES: usize = 256 << 20;

/// A drafter for a given target.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DrafterShape {
    /// The target it drafts for (its widths are the drafter's).
    pub target: ModelShape,
    /// Draft decoder layers.
    pub layers: u64,
    /// Block size B: one anchor token and B-1 masked positions.
    pub block_size: u64,
    /// Target layers whose outputs are fused into the context (0-based decoder layer indices).
    pub target_layers: Vec<u64>,
    /// DFlash 2's convolutions and selector, if it is one.
    pub dflash2: Option<Dflash2Config>,
}

/// `n` target layers spread evenly from layer 1 to layer L-3; one layer: L/2.
/// For Qwen3-8B (36 layers) and n = 5 this is [1, 9, 17, 25, 33].
pub fn spread_target_layers(target_layers: u64, n: u64) -> Vec<u64> {
    if n <= 1 || target_layers < 5 {
        return vec![target_layers / 2; n.min(1) as usize];
    }
    let (first, last) = (1.0, (target_layers - 3) as f64);
    (0..n)
        .map(|i| (first + (last - first) * i as f64 / (n - 1) as f64).round() as u64)
        .collect()
}

impl DrafterShape {
    /// A drafter of `layers` layers and block size `block_size` for `target`, tapping
    /// `target_layers` (or `taps` evenly spread layers when none are given).
    pub fn new(
        target: ModelShape,
        layers: u64,
        block_size: u64,
        target_layers: Option<Vec<u64>>,
        taps: u64,
    ) -> Self {
        let target_layers =
            target_layers.unwrap_or_else(|| spread_target_layers(target.layers, taps));
        Self {
            target,
            layers,
            block_size,
            target_layers,
            dflash2: None,
        }
    }

    /// The same drafter with DFlash 2's additions.
    #[must_use]
    pub fn with_dflash2(mut self, dflash2: Option<Dflash2Config>) -> Self {
        self.dflash2 = dflash2;
        self
    }

    /// DFlash 2's added weights: per layer two convolutions (base kernels and kernel
    /// projections), and the selector's two codebooks and projection.
    pub fn dflash2_parameters(&self) -> u64 {
        let Some(d) = &self.dflash2 else { return 0 };
        let (h, v) = (self.target.hidden, self.target.vocab);
        let (k, r) = (d.conv_kernel_size as u64, d.selector_rank as u64);
        let g = h / (d.conv_group_size as u64).max(1);
        self.layers * 2 * (2 * k * h + 2 * k * g * h) + 2 * v * r + r * h
    }

    /// Tapped layers.
    pub fn taps(&self) -> u64 {
        self.target_layers.len() as u64
    }

    /// Trainable weights: the draft layers, the fusion Linear(n*H -> H) and its RMSNorm, and the
    /// final norm. The embedding and LM head are the target's, frozen.
    pub fn trainable_parameters(&self) -> u64 {
        let h = self.target.hidden;
        self.layers * self.target.layer_parameters()
            + self.taps() * h * h
            + 2 * h
            + self.dflash2_parameters()
    }

    /// FLOPs of one training step on one sequence of `tokens` with `anchors` blocks: forward,
    /// backward (twice the forward) and the frozen LM head (forward, and backward to its input
    /// only). Queries come from the blocks; keys are the context before each anchor (half the
    /// sequence on average) plus the block itself.
    pub fn train_flops(&self, tokens: f64, anchors: f64) -> f64 {
        let t = &self.target;
        let h = t.hidden as f64;
        let queries = anchors * self.block_size as f64;
        let fusion = 2.0 * (self.taps() * t.hidden * t.hidden) as f64 * tokens;
        let block = 2.0 * t.layer_matmul_parameters() as f64 * queries;
        let context_kv = 2.0 * 2.0 * h * (t.kv_heads * t.head_dim) as f64 * tokens;
        let keys = tokens / 2.0 + self.block_size as f64;
        let attention = 4.0 * queries * keys * t.attention_width() as f64;
        // DFlash 2: the kernel projections (two per layer) over the block rows, and the
        // selector's projection; the convolutions and codebook lookups are elementwise.
        let dflash2 = self.dflash2.as_ref().map_or(0.0, |d| {
            let g = (t.hidden / (d.conv_group_size as u64).max(1)) as f64;
            let k = d.conv_kernel_size as f64;
            self.layers as f64 * 2.0 * 2.0 * h * (2.0 * k * g) * queries
                + 2.0 * h * d.selector_rank as f64 * queries
        });
        let forward = fusion + self.layers as f64 * (block + context_kv + attention) + dflash2;
        3.0 * forward + 2.0 * queries * t.lm_head_flops()
    }

    /// Bytes of the hidden states one token contributes when stored offline (bf16, every tap).
    pub fn offline_bytes_per_token(&self) -> u64 {
        self.taps() * self.target.hidden_state_bytes()
    }

    /// Peak training memory of one replica (target + drafter on one device), in bytes, as
    /// `train` holds it: the frozen target in bf16 (or its file size when quantized) less the
    /// layers past the last tap, which it drops; the drafter's bf16 weights and gradients plus
    /// f32 master weights (8 bytes a parameter) and AdamW's moments (`moment_bytes` a
    /// parameter: 8 in f32, 4 in bf16); the draft layers' saved activations; one chunk of the
    /// LM head's logits ([`LM_HEAD_CHUNK_BYTES`]: the head and its loss run in chunks of rows).
    /// Checked against dflash's own Qwen3-8B step: 36.5 GiB of tensors at most (the device
    /// pool's high-water mark) with f32 moments, 32.6 with bf16 (README "On the GPU").
    pub fn train_memory_bytes(
        &self,
        target_weight_bytes: f64,
        tokens: f64,
        anchors: f64,
        moment_bytes: f64,
    ) -> f64 {
        let t = &self.target;
        let queries = anchors * self.block_size as f64;
        let drafter = (8.0 + moment_bytes) * self.trainable_parameters() as f64;
        let per_token_layer = 2.0 * (10 * t.hidden + 4 * t.ffn) as f64;
        let activations = self.layers as f64 * queries * per_token_layer;
        let logits = (queries * t.vocab as f64 * 2.0).min(LM_HEAD_CHUNK_BYTES as f64);
        let taps = tokens * (self.taps() * t.hidden) as f64 * 2.0;
        self.held_target_bytes(target_weight_bytes) + drafter + activations + logits + taps
    }

    /// Of the target's `weight_bytes`, what `train` holds: all but the layers past the last tap
    /// (their share of the weights outside the embedding and LM head).
    fn held_target_bytes(&self, weight_bytes: f64) -> f64 {
        let t = &self.target;
        let kept = self
            .target_layers
            .iter()
            .max()
            .map_or(t.layers, |&l| l + 1)
            .min(t.layers);
        let total = t.parameters() as f64;
        let embeddings = (t.vocab * t.hidden) as f64 * if t.tied_embeddings { 1.0 } else { 2.0 };
        let in_layers = ((total - embeddings) / total.max(1.0)).clamp(0.0, 1.0);
        let dropped = (t.layers - kept) as f64 / (t.layers.max(1)) as f64;
        weight_bytes * (1.0 - in_layers * dropped)
    }
}

/// DFlash 2's settings (the `dflash_config` fields the reference reads).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Dflash2Config {
    /// Convolution taps K (the position itself and the K - 1 before it).
    pub conv_kernel_size: usize,
    /// Channels per group sharing one dynamic kernel; divides the hidden size.
    pub conv_group_size: usize,
    /// The selector's rank r.
    pub selector_rank: usize,
    /// Candidates re-scored per position.
    pub selector_top_k: usize,
}

impl Dflash2Config {
    /// The defaults for a hidden size: kernel 4, groups of 64 channels (or of the largest
    /// divisor of `hidden` up to 64), rank 64, top 8.
    pub fn for_hidden(hidden: usize) -> Self {
        let group = (1..=64.min(hidden))
            .rev()
            .find(|g| hidden % g == 0)
            .unwrap_or(1);
        Self {
            conv_kernel_size: 4,
            conv_group_size: group,
            selector_rank: 64,
            selector_top_k: 8,
        }
    }

    /// What is wrong with these settings for a hidden size and vocabulary, if anything.
    pub fn problem(&self, hidden: usize, vocab: usize) -> Option<String> {
        if self.conv_kernel_size == 0 {
            return Some("`conv_kernel_size` must be at least 1".into());
        }
        if self.conv_group_size == 0 || hidden % self.conv_group_size != 0 {
            return Some(format!(
                "`conv_group_size` {} does not divide the hidden size {hidden}",
                self.conv_group_size
            ));
        }
        if self.selector_rank == 0 {
            return Some("`selector_rank` must be at least 1".into());
        }
        if self.selector_top_k == 0 || self.selector_top_k > vocab {
            return Some(format!(
                "`selector_top_k` {} must be between 1 and the vocabulary ({vocab})",
                self.selector_top_k
            ));
        }
        None
    }

    /// Groups of the hidden size.
    pub fn groups(&self, hidden: usize) -> usize {
        hidden / self.conv_group_size
    }

    /// The added tensors' names and shapes for `layers` layers, in the reference's layout (its
    /// codebooks are stored without `.weight`, which its `from_pretrained` maps).
    pub fn tensors(&self, hidden: usize, vocab: usize, layers: usize) -> Vec<(String, Vec<usize>)> {
        let (k, g, r) = (
            self.conv_kernel_size,
            self.groups(hidden),
            self.selector_rank,
        );
        let mut t = Vec::new();
        for i in 0..layers {
            for conv in ["attention_conv", "mlp_conv"] {
                t.push((format!("layers.{i}.{conv}.base_kernel"), vec![2, k, hidden]));
                t.push((
                    format!("layers.{i}.{conv}.kernel_projection.weight"),
                    vec![2 * k * g, hidden],
                ));
            }
        }
        t.push((PREDECESSOR.into(), vec![vocab, r]));
        t.push((SUCCESSOR.into(), vec![vocab, r]));
        t.push((HIDDEN_PROJECTION.into(), vec![r, hidden]));
        t
    }
}

/// The selector's predecessor codebook `[V, r]`.
pub const PREDECESSOR: &str = "candidate_selector.predecessor_codebook";
/// The selector's successor codebook `[V, r]`.
pub const SUCCESSOR: &str = "candidate_selector.successor_codebook";
/// The selector's hidden projection `[r, H]`.
pub const HIDDEN_PROJECTION: &str = "candidate_selector.hidden_projection.weight";

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn qwen3_8b() -> DrafterShape {
        let t = ModelShape::locate("Qwen/Qwen3-8B", Path::new(".")).unwrap();
        DrafterShape::new(t, 5, 16, None, 5)
    }

    #[test]
    fn a_dflash2_drafter_counts_its_convolutions_and_selector() {
        let d = qwen3_8b();
        let d2 = d
            .clone()
            .with_dflash2(Some(Dflash2Config::for_hidden(4096)));
        // 5 layers x 2 convolutions x (2 x 4 x 4096 + 2 x 4 x 64 x 4096) + 2 x 151936 x 64
        // + 64 x 4096.
        let extra = 5 * 2 * (2 * 4 * 4096 + 2 * 4 * 64 * 4096) + 2 * 151_936 * 64 + 64 * 4096;
        assert_eq!(d2.trainable_parameters() - d.trainable_parameters(), extra);
        assert!(d2.train_flops(3072.0, 512.0) > d.train_flops(3072.0, 512.0));
    }

    #[test]
    fn target_layers_spread_as_the_reference_does() {
        assert_eq!(spread_target_layers(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(spread_target_layers(36, 1), vec![18]);
        assert_eq!(spread_target_layers(30, 3), vec![1, 14, 27]);
    }

    #[test]
    fn qwen3_8b_drafter_matches_dflash_md() {
        let d = qwen3_8b();
        // About 1.05B trainable parameters.
        let p = d.trainable_parameters() as f64 / 1e9;
        assert!((1.04..1.06).contains(&p), "{p}");
        // 73.0 TFLOPs per 3072-token sample with 512 anchors.
        let f = d.train_flops(3072.0, 512.0) / 1e12;
        assert!((72.0..75.0).contains(&f), "{f}");
        // 5 layers x 4096 x 2 bytes per token offline.
        assert_eq!(d.offline_bytes_per_token(), 40_960);
        // dflash's step measured 36.5 GiB of tensors at most (f32 moments), 32.6 with bf16.
        let target = 2.0 * d.target.parameters() as f64;
        let gib = d.train_memory_bytes(target, 3072.0, 512.0, 8.0) / f64::from(1u32 << 30);
        assert!((35.5..38.5).contains(&gib), "{gib}");
        // bf16 moments: 4 bytes a parameter less.
        let bf16 = d.train_memory_bytes(target, 3072.0, 512.0, 4.0) / f64::from(1u32 << 30);
        let less = 4.0 * d.trainable_parameters() as f64 / f64::from(1u32 << 30);
        assert!((gib - bf16 - less).abs() < 1e-9, "{gib} {bf16}");
        assert!((31.5..34.5).contains(&bf16), "{bf16}");
        // The two layers past the last tap (33 of 0..36) are not held: 0.8 GB of 16.4.
        let dropped = target - d.held_target_bytes(target);
        assert!((0.7e9..0.9e9).contains(&dropped), "{dropped}");
    }
}
