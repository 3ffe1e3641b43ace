//! The DFlash drafter (../shared/DFLASH.md): Qwen3-style decoder layers at the target's widths;
//! the tapped target layers fused by `fc` (n*H -> H) and `hidden_norm` into a context that every
//! layer projects with its own `k_proj` / `v_proj` into extra keys and values; queries from the
//! block tokens only; non-causal attention under a block mask; the target's embedding and LM
//! head, frozen. Parameter names are the reference implementation's, so the export is its
//! Hugging Face layout.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var};
use rand::SeedableRng;
use rand_distr::Distribution;

use super::Result;
use super::dflash2::{self, Dflash2Config};
use super::fused::contiguous3;
use super::ops::{self, BlockMask, Linear};
use super::target::TargetConfig;

/// Seeded initialisation, the same on every machine.
pub struct Init(rand_chacha::ChaCha8Rng);

impl Init {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Self(rand_chacha::ChaCha8Rng::seed_from_u64(seed))
    }

    /// Normal(0, std) of `shape`.
    pub fn normal(
        &mut self,
        shape: &[usize],
        std: f64,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let d = rand_distr::Normal::new(0.0f32, std as f32).expect("positive std");
        let v: Vec<f32> = (0..n).map(|_| d.sample(&mut self.0)).collect();
        Tensor::from_vec(v, shape, device)?.to_dtype(dtype)
    }
}

/// The drafter's shape and its DFlash settings.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DrafterConfig {
    /// Hidden size (the target's).
    pub hidden: usize,
    /// Draft layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// MLP width.
    pub ffn: usize,
    /// The embedding table's rows (the target's).
    pub vocab: usize,
    /// RMSNorm epsilon.
    pub eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Tapped target layers (0-based).
    pub target_layers: Vec<usize>,
    /// Block size B.
    pub block_size: usize,
    /// The mask token's id.
    pub mask_token_id: u32,
    /// DFlash 2's convolutions and candidate selector ([`super::dflash2`]); `None`: DFlash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dflash2: Option<Dflash2Config>,
}

impl DrafterConfig {
    /// A drafter of `layers` layers for `target`.
    pub fn for_target(
        target: &TargetConfig,
        layers: usize,
        target_layers: Vec<usize>,
        block_size: usize,
        mask_token_id: u32,
    ) -> Self {
        Self {
            hidden: target.hidden,
            layers,
            heads: target.heads,
            kv_heads: target.kv_heads,
            head_dim: target.head_dim,
            ffn: target.ffn,
            vocab: target.vocab,
            eps: target.eps,
            rope_theta: target.rope_theta,
            target_layers,
            block_size,
            mask_token_id,
            dflash2: None,
        }
    }

    /// The same drafter with DFlash 2's additions.
    pub fn with_dflash2(mut self, dflash2: Dflash2Config) -> Self {
        self.dflash2 = Some(dflash2);
        self
    }

    /// Read [`DrafterConfig::hf_config`]'s output back (a drafter `config.json`); the error
    /// names the missing or mistyped field.
    pub fn from_hf_config(v: &serde_json::Value) -> std::result::Result<Self, String> {
        let int = |v: &serde_json::Value, k: &str| {
            v[k].as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| format!("`{k}` is missing or not an integer"))
        };
        let float = |k: &str| {
            v[k].as_f64()
                .ok_or_else(|| format!("`{k}` is missing or not a number"))
        };
        let dflash = &v["dflash_config"];
        if !dflash.is_object() {
            return Err("no `dflash_config` block: not a DFlash drafter".into());
        }
        let target_layers = dflash["target_layer_ids"]
            .as_array()
            .and_then(|a| a.iter().map(|l| l.as_u64().map(|l| l as usize)).collect())
            .ok_or("`dflash_config.target_layer_ids` is missing or not a list of integers")?;
        let dflash2 = if dflash.get("selector_top_k").is_some()
            || v["architectures"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x == "DFlash2DraftModel"))
        {
            Some(Dflash2Config {
                conv_kernel_size: int(dflash, "conv_kernel_size")?,
                conv_group_size: int(dflash, "conv_group_size")?,
                selector_rank: int(dflash, "selector_rank")?,
                selector_top_k: int(dflash, "selector_top_k")?,
            })
        } else {
            None
        };
        let (hidden, vocab) = (int(v, "hidden_size")?, int(v, "vocab_size")?);
        if let Some(problem) = dflash2.and_then(|d| d.problem(hidden, vocab)) {
            return Err(format!("dflash_config: {problem}"));
        }
        Ok(Self {
            hidden,
            layers: int(v, "num_hidden_layers")?,
            heads: int(v, "num_attention_heads")?,
            kv_heads: int(v, "num_key_value_heads")?,
            head_dim: int(v, "head_dim")?,
            ffn: int(v, "intermediate_size")?,
            vocab,
            eps: float("rms_norm_eps")?,
            rope_theta: float("rope_theta")?,
            target_layers,
            block_size: int(dflash, "block_size").or_else(|_| int(v, "block_size"))?,
            mask_token_id: int(dflash, "mask_token_id")? as u32,
            dflash2,
        })
    }

    /// Every trainable tensor's name and shape, in a fixed order.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, q, kv) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        );
        let mut t = vec![
            (
                "fc.weight".to_owned(),
                vec![h, self.target_layers.len() * h],
            ),
            ("hidden_norm.weight".to_owned(), vec![h]),
            ("norm.weight".to_owned(), vec![h]),
        ];
        for i in 0..self.layers {
            let p = format!("layers.{i}");
            t.extend([
                (format!("{p}.input_layernorm.weight"), vec![h]),
                (format!("{p}.post_attention_layernorm.weight"), vec![h]),
                (format!("{p}.self_attn.q_proj.weight"), vec![q, h]),
                (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.o_proj.weight"), vec![h, q]),
                (format!("{p}.self_attn.q_norm.weight"), vec![self.head_dim]),
                (format!("{p}.self_attn.k_norm.weight"), vec![self.head_dim]),
                (format!("{p}.mlp.gate_proj.weight"), vec![self.ffn, h]),
                (format!("{p}.mlp.up_proj.weight"), vec![self.ffn, h]),
                (format!("{p}.mlp.down_proj.weight"), vec![h, self.ffn]),
            ]);
        }
        if let Some(d) = &self.dflash2 {
            t.extend(d.tensors(h, self.vocab, self.layers));
        }
        t
    }

    /// Trainable parameters.
    pub fn parameters(&self) -> usize {
        self.tensors()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }

    /// The Hugging Face `config.json` of the reference implementation (a Qwen3 config with a
    /// `dflash_config` block), which SGLang and vLLM load for DFlash.
    pub fn hf_config(&self, target_family: &str) -> serde_json::Value {
        let mut v = serde_json::json!({
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "rms_norm_eps": self.eps,
            "rope_theta": self.rope_theta,
            "hidden_act": "silu",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "block_size": self.block_size,
            "num_target_layers": self.target_layers.len(),
            "dflash_config": {
                "target_layer_ids": self.target_layers,
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_model_type": target_family,
            },
        });
        if let Some(d) = &self.dflash2 {
            // `DFlash2DraftModel` (its harness picks the class by this name).
            v["architectures"] = serde_json::json!(["DFlash2DraftModel"]);
            let block = &mut v["dflash_config"];
            block["conv_kernel_size"] = d.conv_kernel_size.into();
            block["conv_group_size"] = d.conv_group_size.into();
            block["selector_rank"] = d.selector_rank.into();
            block["selector_top_k"] = d.selector_top_k.into();
        }
        v
    }
}

/// A drafter's trainable weights.
pub struct Drafter {
    /// Its shape.
    pub config: DrafterConfig,
    /// By name (the reference implementation's).
    pub vars: BTreeMap<String, Var>,
    /// In a [`Self::frozen`] copy: the same weights detached from their variables, which its
    /// passes read instead.
    detached: Option<BTreeMap<String, Tensor>>,
}

/// Every drafter layer's keys and values for the context rows seen so far.
#[derive(Clone, Debug)]
pub struct ContextKv {
    /// Per layer: `[kv_heads, s, head_dim]` keys (normed, rotated) and values.
    layers: Vec<(Tensor, Tensor)>,
    len: usize,
}

impl ContextKv {
    /// Context rows held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no context row is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Append the rows of `more` (from [`Drafter::context_kv`] at the following positions).
    pub fn extend(&mut self, more: ContextKv) -> Result<()> {
        for ((k, v), (mk, mv)) in self.layers.iter_mut().zip(more.layers) {
            *k = Tensor::cat(&[&*k, &mk], 1)?;
            *v = Tensor::cat(&[&*v, &mv], 1)?;
        }
        self.len += more.len;
        Ok(())
    }
}

impl Drafter {
    /// Fresh weights: linear layers Normal(0, 0.02), norms at 1 (Hugging Face's init).
    pub fn init(config: DrafterConfig, seed: u64, dtype: DType, device: &Device) -> Result<Self> {
        let mut rng = Init::new(seed);
        let mut vars = BTreeMap::new();
        for (name, shape) in config.tensors() {
            let t = if let Some(v) = dflash2::initial(&name, &shape) {
                Tensor::from_vec(v, shape.as_slice(), device)?.to_dtype(dtype)?
            } else if shape.len() == 1 {
                Tensor::ones(shape.as_slice(), dtype, device)?
            } else {
                rng.normal(&shape, 0.02, dtype, device)?
            };
            vars.insert(name, Var::from_tensor(&t)?);
        }
        Ok(Self {
            config,
            vars,
            detached: None,
        })
    }

    /// Weights from tensors by name (a checkpoint); every tensor must be present at its shape.
    pub fn from_tensors(
        config: DrafterConfig,
        tensors: &std::collections::HashMap<String, Tensor>,
    ) -> Result<Self> {
        let mut vars = BTreeMap::new();
        for (name, shape) in config.tensors() {
            let t = tensors
                .get(&name)
                .ok_or_else(|| candle_core::Error::Msg(format!("checkpoint lacks `{name}`")))?;
            if t.dims() != shape.as_slice() {
                candle_core::bail!("checkpoint `{name}` is {:?}, expected {shape:?}", t.dims());
            }
            vars.insert(name, Var::from_tensor(t)?);
        }
        Ok(Self {
            config,
            vars,
            detached: None,
        })
    }

    /// A trainable tensor by name (detached in a [`Self::frozen`] copy).
    pub fn w(&self, name: &str) -> &Tensor {
        match &self.detached {
            Some(weights) => &weights[name],
            None => self.vars[name].as_tensor(),
        }
    }

    /// The same weights (the storage shared, nothing copied) for passes that need no gradient:
    /// decoding. Every op on a variable records its inputs for the backward pass, so a pass
    /// over the variables themselves builds a graph nobody differentiates, keeps every
    /// round's context alive through it, and takes the training forms of the ops (a
    /// tracked copy, a block attention that saves its probabilities) where decoding has
    /// cheaper ones.
    pub fn frozen(&self) -> Self {
        Self {
            config: self.config.clone(),
            vars: self.vars.clone(),
            detached: Some(
                self.vars
                    .iter()
                    .map(|(n, v)| (n.clone(), v.as_tensor().detach()))
                    .collect(),
            ),
        }
    }

    /// A linear layer's weights in the activations' `dtype`: the trainable weights stay where
    /// they are (f32 when training, the master copy AdamW updates) and the cast is part of the
    /// graph, so the gradient reaches them in their own dtype (mixed precision on a GPU).
    fn lin(&self, name: &str, dtype: DType) -> Result<Linear> {
        Ok(Linear::Dense(self.w(name).to_dtype(dtype)?))
    }

    /// The drafter's final hidden states for the block tokens: `[m, H]`.
    ///
    /// `context`: the tapped target layers `[s, n*H]` at positions `context_pos`; `block`: the
    /// block tokens' embeddings `[m, H]` at positions `block_pos`; `mask`: what each block sees
    /// (see [`Self::forward_block`]).
    pub fn forward(
        &self,
        context: &Tensor,
        context_pos: &[u32],
        block: &Tensor,
        block_pos: &[u32],
        mask: &BlockMask,
    ) -> Result<Tensor> {
        let ctx = self.context_kv(context, context_pos)?;
        self.forward_block(&ctx, block, block_pos, mask)
    }

    /// Every layer's keys and values for context rows (the tapped target layers `[s, n*H]` at
    /// `positions`): they depend on the context alone, so decoding computes them once per
    /// accepted token ([`ContextKv::extend`]) instead of once per block.
    pub fn context_kv(&self, context: &Tensor, positions: &[u32]) -> Result<ContextKv> {
        let c = &self.config;
        let s = context.dim(0)?;
        let (dtype, device) = (context.dtype(), context.device());
        let ctx = ops::rms_norm(
            &self.lin("fc.weight", dtype)?.forward(context)?,
            self.w("hidden_norm.weight"),
            c.eps,
        )?;
        let (cos, sin) = ops::rope_tables(positions, c.head_dim, c.rope_theta, dtype, device)?;
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let p = |n: &str| format!("layers.{i}.{n}");
            let (k, v) = self.kv(&ctx, s, &p, &cos, &sin)?;
            layers.push((k, v));
        }
        Ok(ContextKv { layers, len: s })
    }

    /// One layer's normed, rotated keys `[kv_heads, s, d]` and values for rows `x` `[s, H]`.
    fn kv(
        &self,
        x: &Tensor,
        s: usize,
        p: &dyn Fn(&str) -> String,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let c = &self.config;
        let k = self
            .lin(&p("self_attn.k_proj.weight"), x.dtype())?
            .forward(x)?;
        let k = self.normed_heads(&k, c.kv_heads, &p("self_attn.k_norm.weight"))?;
        let v = contiguous3(
            &self
                .lin(&p("self_attn.v_proj.weight"), x.dtype())?
                .forward(x)?
                .reshape((s, c.kv_heads, c.head_dim))?
                .transpose(0, 1)?,
        )?;
        Ok((ops::rope(&k, cos, sin)?, v))
    }

    /// Projected rows `x` `[n, heads * head_dim]` as heads `[heads, n, head_dim]`, each
    /// RMS-normed with the weights `norm`. Into heads with `contiguous3`: on a GPU, when
    /// decoding, one launch with the strides as arguments (in training the tensors are tracked
    /// and candle copies them).
    fn normed_heads(&self, x: &Tensor, heads: usize, norm: &str) -> Result<Tensor> {
        let c = &self.config;
        contiguous3(
            &ops::rms_norm(
                &x.reshape((x.dim(0)?, heads, c.head_dim))?,
                self.w(norm),
                c.eps,
            )?
            .transpose(0, 1)?,
        )
    }

    /// The blocks' final hidden states `[m, H]` (m a multiple of the block size B) given the
    /// context's keys and values; `mask`: what each block sees of the context (all of its own
    /// block, always).
    pub fn forward_block(
        &self,
        ctx: &ContextKv,
        block: &Tensor,
        block_pos: &[u32],
        mask: &BlockMask,
    ) -> Result<Tensor> {
        self.forward_packed(ctx, block, block_pos, std::slice::from_ref(mask))
    }

    /// [`Self::forward_block`] for sequences packed one after another (their context rows in
    /// `ctx`, their blocks in `block`, in the same order); `masks[i]`: what sequence i's blocks
    /// see of its own context ([`ops::packed_block_attention`]).
    pub fn forward_packed(
        &self,
        ctx: &ContextKv,
        block: &Tensor,
        block_pos: &[u32],
        masks: &[BlockMask],
    ) -> Result<Tensor> {
        let c = &self.config;
        let m = block.dim(0)?;
        let (dtype, device) = (block.dtype(), block.device());
        let (cos, sin) = ops::rope_tables(block_pos, c.head_dim, c.rope_theta, dtype, device)?;
        let mut x = block.clone();
        // DFlash 2: each block convolved on its own (see `dflash2`); a pass over fewer rows
        // than a block (the end of a decode) is one short block.
        let rows_per_block = if m % c.block_size == 0 {
            c.block_size
        } else {
            m
        };
        let conv = |name: String, h: &Tensor| -> Result<Option<(Tensor, Tensor)>> {
            let Some(d) = &c.dflash2 else {
                return Ok(None);
            };
            let (before, after) = dflash2::dynamic_kernels(
                h,
                self.w(&format!("{name}.kernel_projection.weight")),
                d,
            )?;
            let base = self.w(&format!("{name}.base_kernel"));
            let mixed = dflash2::convolve(h, &before, &base.get(0)?, rows_per_block)?;
            Ok(Some((mixed, after)))
        };
        let finish = |name: String, out: Tensor, after: Option<Tensor>| -> Result<Tensor> {
            match after {
                None => Ok(out),
                Some(after) => {
                    let base = self.w(&format!("{name}.base_kernel")).get(1)?;
                    dflash2::convolve(&out, &after, &base, rows_per_block)
                }
            }
        };
        for (i, (ck, cv)) in ctx.layers.iter().enumerate() {
            let p = |n: &str| format!("layers.{i}.{n}");
            let h = ops::rms_norm(&x, self.w(&p("input_layernorm.weight")), c.eps)?;
            let (h, after) = match conv(p("attention_conv"), &h)? {
                Some((h, after)) => (h, Some(after)),
                None => (h, None),
            };
            let q = self
                .lin(&p("self_attn.q_proj.weight"), dtype)?
                .forward(&h)?;
            let q = self.normed_heads(&q, c.heads, &p("self_attn.q_norm.weight"))?;
            let q = ops::rope(&q, &cos, &sin)?;
            let (bk, bv) = self.kv(&h, m, &p, &cos, &sin)?;
            let a = ops::packed_block_attention(
                &q.contiguous()?,
                (ck, cv),
                (&bk, &bv),
                c.block_size,
                masks,
            )?;
            let a = contiguous3(&a.transpose(0, 1)?)?.reshape((m, c.heads * c.head_dim))?;
            let a = self
                .lin(&p("self_attn.o_proj.weight"), dtype)?
                .forward(&a)?;
            x = (x + finish(p("attention_conv"), a, after)?)?;
            let h = ops::rms_norm(&x, self.w(&p("post_attention_layernorm.weight")), c.eps)?;
            let (h, after) = match conv(p("mlp_conv"), &h)? {
                Some((h, after)) => (h, Some(after)),
                None => (h, None),
            };
            let mlp = ops::swiglu(
                &h,
                &self.lin(&p("mlp.gate_proj.weight"), dtype)?,
                &self.lin(&p("mlp.up_proj.weight"), dtype)?,
                &self.lin(&p("mlp.down_proj.weight"), dtype)?,
            )?;
            x = (x + finish(p("mlp_conv"), mlp, after)?)?;
        }
        ops::rms_norm(&x, self.w("norm.weight"), c.eps)
    }

    /// The gradient of every trainable tensor that has one in `grads`, by name.
    pub fn gradients(&self, grads: &candle_core::backprop::GradStore) -> BTreeMap<String, Tensor> {
        self.vars
            .iter()
            .filter_map(|(n, v)| grads.get(v.as_tensor()).map(|g| (n.clone(), g.clone())))
            .collect()
    }

    /// The weights as named tensors, in `dtype` (for checkpoints and the export).
    pub fn tensors(&self, dtype: DType) -> Result<std::collections::HashMap<String, Tensor>> {
        self.vars
            .iter()
            .map(|(k, v)| Ok((k.clone(), v.as_tensor().to_dtype(dtype)?)))
            .collect()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::nn::objective::{Batch, loss};
    use crate::nn::target::{Target, TargetConfig};

    pub(crate) fn tiny_target(dtype: DType) -> Target {
        let config = TargetConfig {
            family: "qwen3".into(),
            hidden: 16,
            layers: 4,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            ffn: 24,
            vocab: 40,
            eps: 1e-6,
            rope_theta: 10_000.0,
            qk_norm: true,
            context: 4096,
            hybrid: None,
        };
        Target::random(config, 1, dtype, &Device::Cpu).unwrap()
    }

    pub(crate) fn sequence() -> (Vec<u32>, Vec<i8>) {
        let ids: Vec<u32> = (0..14).map(|i| (i * 7 + 3) % 39).collect();
        let mask: Vec<i8> = (0..14).map(|i| i8::from(i >= 4)).collect();
        (ids, mask)
    }

    #[test]
    fn the_exported_config_reads_back() {
        let t = tiny_target(DType::F32);
        let c = DrafterConfig::for_target(&t.config, 2, vec![0, 3], 8, 39);
        assert_eq!(
            DrafterConfig::from_hf_config(&c.hf_config("qwen3")),
            Ok(c.clone())
        );
        let mut broken = c.hf_config("qwen3");
        broken["dflash_config"]["mask_token_id"] = "x".into();
        let e = DrafterConfig::from_hf_config(&broken).unwrap_err();
        assert!(e.contains("mask_token_id"), "{e}");
        // A DFlash 2 config reads back too; settings no drafter can run are refused, not run.
        let d2 = c.clone().with_dflash2(Dflash2Config::for_hidden(16));
        assert_eq!(
            DrafterConfig::from_hf_config(&d2.hf_config("qwen3")),
            Ok(d2.clone())
        );
        for (key, value) in [
            ("conv_kernel_size", 0),
            ("conv_group_size", 5),
            ("selector_top_k", 99),
        ] {
            let mut bad = d2.hf_config("qwen3");
            bad["dflash_config"][key] = value.into();
            let e = DrafterConfig::from_hf_config(&bad).unwrap_err();
            assert!(e.contains(key), "{key}: {e}");
        }
    }

    /// Every trainable tensor's gradient against central finite differences, in f64.
    #[test]
    fn gradients_match_finite_differences() {
        check_gradients(None);
    }

    /// The same for DFlash 2: the convolutions' base kernels and projections, the selector's
    /// codebooks and projection, through both losses.
    #[test]
    fn dflash2_gradients_match_finite_differences() {
        check_gradients(Some(Dflash2Config {
            conv_kernel_size: 3,
            conv_group_size: 4,
            selector_rank: 3,
            // Every token a candidate: a smaller set changes where two logits cross, and the
            // loss jumps there (finite differences would see the jump, not the gradient).
            selector_top_k: 40,
        }));
    }

    /// A GPU runs the drafter's activations in bf16 with f32 master weights: DFlash 2's loss
    /// and its backward must hold together in those dtypes too (CPU has bf16 ops).
    #[test]
    fn dflash2_trains_with_bf16_activations() {
        let target = tiny_target(DType::BF16);
        let config = DrafterConfig::for_target(&target.config, 2, vec![0, 2], 4, 39).with_dflash2(
            Dflash2Config {
                conv_kernel_size: 3,
                conv_group_size: 4,
                selector_rank: 3,
                selector_top_k: 6,
            },
        );
        let drafter = Drafter::init(config, 7, DType::F32, &Device::Cpu).unwrap();
        let (ids, mask) = sequence();
        let context = target.tapped(&ids, &drafter.config.target_layers).unwrap();
        assert_eq!(context.dtype(), DType::BF16);
        let batch = Batch::sample(&ids, &mask, 3, 4, 39, 2.0, 5).unwrap();
        let embed = |t: &Tensor| target.embed(t);
        let (l, m) = loss(
            &drafter,
            &embed,
            &target.lm_head,
            &context,
            &batch,
            batch.weight(),
        )
        .unwrap();
        assert!(m.loss.is_finite() && m.blocks == 3);
        let grads = l.backward().unwrap();
        let g = drafter.gradients(&grads);
        assert_eq!(g.len(), drafter.vars.len(), "every tensor gets a gradient");
        assert!(g.values().all(|t| t.dtype() == DType::F32));
    }

    fn check_gradients(dflash2: Option<Dflash2Config>) {
        let dtype = DType::F64;
        let target = tiny_target(dtype);
        let mut config = DrafterConfig::for_target(&target.config, 2, vec![0, 2], 4, 39);
        config.dflash2 = dflash2;
        let drafter = Drafter::init(config, 7, dtype, &Device::Cpu).unwrap();
        // Perturb the norms off 1, and DFlash 2's identity kernels and small codebooks, so
        // their gradients are generic.
        let mut init = Init::new(11);
        for (name, var) in &drafter.vars {
            let shape = var.as_tensor().dims().to_vec();
            if name.ends_with("norm.weight") {
                let n = var.as_tensor().dim(0).unwrap();
                let v: Vec<f64> = (0..n)
                    .map(|i| 1.0 + 0.1 * ((i * 13 % 7) as f64 - 3.0) / 3.0)
                    .collect();
                var.set(&Tensor::new(v, &Device::Cpu).unwrap()).unwrap();
            } else if name.contains("_conv.") || name.starts_with("candidate_selector") {
                let noise = init.normal(&shape, 0.3, dtype, &Device::Cpu).unwrap();
                var.set(&(var.as_tensor() + noise).unwrap()).unwrap();
            }
        }
        let (ids, mask) = sequence();
        let context = target.tapped(&ids, &drafter.config.target_layers).unwrap();
        let batch = Batch::sample(&ids, &mask, 3, 4, 39, 2.0, 5).unwrap();
        let embed = |t: &Tensor| target.embed(t);
        let f = || {
            loss(
                &drafter,
                &embed,
                &target.lm_head,
                &context,
                &batch,
                batch.weight(),
            )
            .unwrap()
        };
        let (l, _) = f();
        let grads = l.backward().unwrap();
        let h = 1e-5;
        let mut checked = 0;
        for (name, var) in &drafter.vars {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("no gradient for {name}"));
            let g: Vec<f64> = g.flatten_all().unwrap().to_vec1().unwrap();
            let w: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            let shape = var.as_tensor().shape().clone();
            // A few coordinates of every tensor, spread over it, and its largest gradient
            // (a codebook's rows mostly have none), which must not be zero.
            let largest = (0..g.len())
                .max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs()))
                .unwrap();
            assert!(g[largest].abs() > 1e-9, "{name} gets no gradient");
            let spread = (0..w.len()).step_by((w.len() / 5).max(1));
            for i in spread.chain([largest]) {
                let at = |x: f64| {
                    let mut p = w.clone();
                    p[i] = x;
                    var.set(&Tensor::from_vec(p, &shape, &Device::Cpu).unwrap())
                        .unwrap();
                    f().0.to_scalar::<f64>().unwrap()
                };
                let numeric = (at(w[i] + h) - at(w[i] - h)) / (2.0 * h);
                var.set(&Tensor::from_vec(w.clone(), &shape, &Device::Cpu).unwrap())
                    .unwrap();
                let err = (numeric - g[i]).abs() / (numeric.abs() + g[i].abs()).max(1e-6);
                assert!(
                    err < 1e-4,
                    "{name}[{i}]: analytic {} numeric {numeric}",
                    g[i]
                );
                checked += 1;
            }
        }
        assert!(checked > 100, "{checked}");
    }

    /// Sequences of different lengths packed into one pass: the loss, the metrics and every
    /// gradient are those of the sequences run one at a time, summed.
    #[test]
    fn a_packed_pass_is_the_sum_of_the_sequences_passes() {
        packed_equals_separate(None);
        // DFlash 2's convolutions stay within each block of the packed rows.
        packed_equals_separate(Some(Dflash2Config {
            conv_kernel_size: 3,
            conv_group_size: 4,
            selector_rank: 3,
            selector_top_k: 6,
        }));
    }

    /// The LM head in chunks of rows (what a GPU runs) gives the loss, the metrics and every
    /// gradient the whole logits give (what CPU runs), DFlash and DFlash 2 both.
    #[test]
    fn the_chunked_head_trains_as_the_whole_one() {
        use crate::nn::objective::{Head, StepMetrics, loss_packed};
        for dflash2 in [
            None,
            Some(Dflash2Config {
                conv_kernel_size: 3,
                conv_group_size: 4,
                selector_rank: 3,
                selector_top_k: 6,
            }),
        ] {
            let target = tiny_target(DType::F64);
            let mut config = DrafterConfig::for_target(&target.config, 2, vec![0, 2], 4, 39);
            config.dflash2 = dflash2;
            let drafter = Drafter::init(config, 3, DType::F64, &Device::Cpu).unwrap();
            let (ids, mask) = sequence();
            let context = target.tapped(&ids, &drafter.config.target_layers).unwrap();
            let batch = Batch::sample(&ids, &mask, 3, 4, 39, 2.0, 5).unwrap();
            let embed = |t: &Tensor| target.embed(t);
            let run = |head: Head| -> (f64, StepMetrics, Vec<Tensor>) {
                let (l, m) = loss_packed(
                    &drafter,
                    &embed,
                    &target.lm_head,
                    &context,
                    &[&batch],
                    batch.weight(),
                    head,
                )
                .unwrap();
                let g = drafter.gradients(&l.backward().unwrap());
                (l.to_scalar().unwrap(), m, g.into_values().collect())
            };
            let (whole, wm, wg) = run(Head::Whole);
            let (chunked, cm, cg) = run(Head::Chunked);
            assert!((whole - chunked).abs() < 1e-12, "{whole} vs {chunked}");
            assert_eq!(
                (wm.correct, wm.counted, wm.accepted),
                (cm.correct, cm.counted, cm.accepted)
            );
            assert_eq!(wg.len(), cg.len());
            for (a, b) in wg.iter().zip(&cg) {
                let diff = crate::nn::testing::max_diff(a, b);
                assert!(diff < 1e-12, "{diff}");
            }
        }
    }

    /// Moves the weights whose names contain `part` off their init by N(0, 0.3) noise (seeded).
    pub(crate) fn perturb(drafter: &Drafter, part: &str) {
        let mut init = Init::new(5);
        for (name, var) in &drafter.vars {
            if name.contains(part) {
                let noise = init
                    .normal(var.as_tensor().dims(), 0.3, var.dtype(), &Device::Cpu)
                    .unwrap();
                var.set(&(var.as_tensor() + noise).unwrap()).unwrap();
            }
        }
    }

    /// Three sequences of 14, 9 and 21 tokens over the tiny target's vocabulary (the first two
    /// untrained) and blocks of 4 drawn from each: what the packing tests stack.
    pub(crate) fn three_sequences() -> (Vec<(Vec<u32>, Vec<i8>)>, Vec<Batch>) {
        let seqs: Vec<(Vec<u32>, Vec<i8>)> = [14usize, 9, 21]
            .iter()
            .map(|&n| {
                let ids = (0..n as u32).map(|i| (i * 11 + n as u32) % 39).collect();
                (ids, (0..n).map(|i| i8::from(i >= 2)).collect())
            })
            .collect();
        let batches = seqs
            .iter()
            .enumerate()
            .map(|(i, (ids, mask))| Batch::sample(ids, mask, 3, 4, 39, 2.0, i as u64).unwrap())
            .collect();
        (seqs, batches)
    }

    fn packed_equals_separate(dflash2: Option<Dflash2Config>) {
        let dtype = DType::F64;
        let target = tiny_target(dtype);
        let mut config = DrafterConfig::for_target(&target.config, 2, vec![0, 2], 4, 39);
        config.dflash2 = dflash2;
        let drafter = Drafter::init(config, 3, dtype, &Device::Cpu).unwrap();
        // Kernels off the identity, so a convolution across blocks would show.
        perturb(&drafter, "_conv.");
        let taps = drafter.config.target_layers.clone();
        let (seqs, batches) = three_sequences();
        let embed = |t: &Tensor| target.embed(t);
        let norm: f64 = batches.iter().map(Batch::weight).sum();
        let grads_of = |loss: &Tensor| -> Vec<Tensor> {
            let g = loss.backward().unwrap();
            drafter.gradients(&g).into_values().collect()
        };
        // One at a time.
        let mut sum = 0.0;
        let mut metrics = crate::nn::objective::StepMetrics::default();
        let mut grads: Vec<Tensor> = Vec::new();
        for ((ids, _), b) in seqs.iter().zip(&batches) {
            let context = target.tapped(ids, &taps).unwrap();
            let (l, m) = loss(&drafter, &embed, &target.lm_head, &context, b, norm).unwrap();
            sum += l.to_scalar::<f64>().unwrap();
            metrics.add(&m);
            let g = grads_of(&l);
            grads = if grads.is_empty() {
                g
            } else {
                grads.iter().zip(g).map(|(a, b)| (a + b).unwrap()).collect()
            };
        }
        // Packed.
        let contexts: Vec<Tensor> = seqs
            .iter()
            .map(|(ids, _)| target.tapped(ids, &taps).unwrap())
            .collect();
        let context = Tensor::cat(&contexts, 0).unwrap();
        let refs: Vec<&Batch> = batches.iter().collect();
        let (l, m) = crate::nn::objective::loss_packed(
            &drafter,
            &embed,
            &target.lm_head,
            &context,
            &refs,
            norm,
            crate::nn::objective::Head::Whole,
        )
        .unwrap();
        assert!((l.to_scalar::<f64>().unwrap() - sum).abs() < 1e-12);
        assert_eq!(
            (m.correct, m.counted, m.accepted, m.blocks),
            (
                metrics.correct,
                metrics.counted,
                metrics.accepted,
                metrics.blocks
            )
        );
        let packed = grads_of(&l);
        assert_eq!(packed.len(), grads.len());
        for (a, b) in packed.iter().zip(&grads) {
            let diff: f64 = (a - b)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar()
                .unwrap();
            assert!(diff < 1e-12, "{diff}");
        }
        // Masks that do not add up to the packed rows are refused.
        let short: Vec<&Batch> = batches.iter().take(2).collect();
        assert!(
            crate::nn::objective::loss_packed(
                &drafter,
                &embed,
                &target.lm_head,
                &context,
                &short,
                norm,
                crate::nn::objective::Head::Whole,
            )
            .is_err()
        );
    }

    #[test]
    fn blocks_see_only_their_context_and_themselves() {
        let (ids, mask) = sequence();
        let b = Batch::sample(&ids, &mask, 2, 4, 39, 2.0, 1).unwrap();
        let m: Vec<Vec<f32>> = b
            .mask()
            .additive(DType::F32, &Device::Cpu)
            .unwrap()
            .to_vec2()
            .unwrap();
        let s = ids.len();
        for (j, &a) in b.anchors.iter().enumerate() {
            assert!(mask[a] == 1 && mask[a + 1] == 1);
            for r in j * 4..(j + 1) * 4 {
                for c in 0..s {
                    assert_eq!(m[r][c] == 0.0, c < a, "row {r} col {c} anchor {a}");
                }
                // Its own block, all of it; other blocks are not among its keys at all.
                assert_eq!(m[r].len(), s + 4);
                assert!(m[r][s..].iter().all(|&x| x == 0.0));
            }
        }
        // Labels are the next tokens; weights decay with k and vanish where not trained.
        assert_eq!(b.labels[0], ids[b.anchors[0] + 1]);
        assert!(b.weights[0] > b.weights[1] || b.weights[1] == 0.0);
    }

    #[test]
    fn block_attention_is_dense_attention_under_the_block_mask() {
        let mut init = Init::new(3);
        let cpu = Device::Cpu;
        let (heads, kv, d, s, b, blocks) = (4, 2, 8, 6, 4, 3);
        let m = b * blocks;
        let q = init.normal(&[heads, m, d], 1.0, DType::F64, &cpu).unwrap();
        let (ck, cv) = (
            init.normal(&[kv, s, d], 1.0, DType::F64, &cpu).unwrap(),
            init.normal(&[kv, s, d], 1.0, DType::F64, &cpu).unwrap(),
        );
        let (bk, bv) = (
            init.normal(&[kv, m, d], 1.0, DType::F64, &cpu).unwrap(),
            init.normal(&[kv, m, d], 1.0, DType::F64, &cpu).unwrap(),
        );
        let anchors = [0usize, 2, 5];
        let open = |ok: bool| if ok { 0.0 } else { f64::NEG_INFINITY };
        let mut dense = Vec::new();
        for r in 0..m {
            let a = anchors[r / b];
            dense.extend((0..s + m).map(|c| open(c < a || (c >= s && (c - s) / b == r / b))));
        }
        let local = BlockMask::new(anchors.iter().map(|&a| a as u32).collect(), s, b);
        let dense = Tensor::from_vec(dense, (m, s + m), &cpu).unwrap();
        // Values and the gradients of all five inputs, against dense attention's.
        let up = init.normal(&[heads, m, d], 1.0, DType::F64, &cpu).unwrap();
        let run = |block_local: bool| {
            let vars: Vec<Var> = [&q, &ck, &cv, &bk, &bv]
                .iter()
                .map(|t| Var::from_tensor(t).unwrap())
                .collect();
            let t: Vec<&Tensor> = vars.iter().map(Var::as_tensor).collect();
            let out = if block_local {
                ops::block_attention(t[0], (t[1], t[2]), (t[3], t[4]), b, &local).unwrap()
            } else {
                let k = Tensor::cat(&[t[1], t[3]], 1).unwrap();
                let v = Tensor::cat(&[t[2], t[4]], 1).unwrap();
                ops::attention(t[0], &k, &v, &dense).unwrap()
            };
            let grads = (&out * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let mut all = vec![out];
            all.extend(t.iter().map(|x| grads.get(x).unwrap().clone()));
            all
        };
        for (i, (a, b)) in run(true).iter().zip(run(false)).enumerate() {
            assert!(crate::nn::testing::max_diff(a, &b) < 1e-12, "tensor {i}");
        }
    }

    /// A decoding round's block (one block seeing its whole context) through plain attention
    /// gives what the blocks' general form gives.
    #[test]
    fn a_block_seeing_its_whole_context_is_plain_attention() {
        let cpu = Device::Cpu;
        let mut init = Init::new(5);
        let (heads, kv, s, b, d) = (6, 2, 9, 4, 8);
        let q = init.normal(&[heads, b, d], 1.0, DType::F32, &cpu).unwrap();
        let t =
            |n: usize, init: &mut Init| init.normal(&[kv, n, d], 1.0, DType::F32, &cpu).unwrap();
        let (ck, cv, bk, bv) = (
            t(s, &mut init),
            t(s, &mut init),
            t(b, &mut init),
            t(b, &mut init),
        );
        let mask = BlockMask::new(vec![s as u32], s, b);
        let want = ops::block_attention(&q, (&ck, &cv), (&bk, &bv), b, &mask).unwrap();
        let got = ops::single_block_attention(&q, (&ck, &cv), (&bk, &bv)).unwrap();
        assert_eq!(got.dims(), want.dims());
        let diff = crate::nn::testing::max_diff(&got, &want);
        assert!(diff < 1e-5, "{diff}");
    }

    /// A frozen copy (decoding's) computes the same values as the trainable drafter, from the
    /// same storage, and records no graph; training's copy still does.
    #[test]
    fn a_frozen_drafter_passes_the_same_values_and_records_no_graph() {
        let target = tiny_target(DType::F64);
        for dflash2 in [None, Some(Dflash2Config::for_hidden(16))] {
            let mut config = DrafterConfig::for_target(&target.config, 2, vec![0, 3], 4, 39);
            if let Some(d) = dflash2 {
                config = config.with_dflash2(d);
            }
            let trained = Drafter::init(config, 3, DType::F64, &Device::Cpu).unwrap();
            let frozen = trained.frozen();
            let mut init = Init::new(9);
            let (s, b) = (6, 4);
            let taps = init
                .normal(&[s, 2 * 16], 1.0, DType::F64, &Device::Cpu)
                .unwrap();
            let block = init
                .normal(&[b, 16], 1.0, DType::F64, &Device::Cpu)
                .unwrap();
            let context_pos: Vec<u32> = (0..s as u32).collect();
            let block_pos: Vec<u32> = (s as u32..(s + b) as u32).collect();
            let mask = BlockMask::new(vec![s as u32], s, b);
            let pass = |d: &Drafter| {
                d.forward(&taps, &context_pos, &block, &block_pos, &mask)
                    .unwrap()
            };
            let (tracked, plain) = (pass(&trained), pass(&frozen));
            assert!(tracked.track_op(), "training's pass records its graph");
            assert!(!plain.track_op(), "a frozen pass records none");
            assert_eq!(
                tracked.to_vec2::<f64>().unwrap(),
                plain.to_vec2::<f64>().unwrap()
            );
            // The same storage: an update to the variables is what the frozen copy reads.
            for (name, var) in &trained.vars {
                var.set(&(var.as_tensor() * 0.5).unwrap()).unwrap();
                let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
                assert_eq!(values(frozen.w(name)), values(var.as_tensor()), "{name}");
            }
        }
    }
}
