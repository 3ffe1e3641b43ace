//! A decoder-only transformer's dimensions, where they came from, and what follows from them:
//! parameter counts, forward FLOPs and the bytes of its hidden states.
//!
//! Shapes are read from a Hugging Face `config.json` (a model folder), from a GGUF file's metadata
//! (its tensor list gives the exact parameter count), or — for Hub ids, which this code never
//! downloads — from a small table of well-known models. [`ShapeSource`] says which, so a user sees
//! whether a figure rests on their files or on dflash's table.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::SystemTime;

use dflash_stage_api::StageError;
use dflash_stage_api::gguf::{self, Meta};
use serde::Serialize;
use serde_json::Value;

/// Where a shape was read from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "from", content = "at", rename_all = "snake_case")]
pub enum ShapeSource {
    /// A Hugging Face `config.json`.
    ConfigJson(PathBuf),
    /// A GGUF file's metadata.
    Gguf(PathBuf),
    /// dflash's table of well-known models, by Hub id.
    Known(String),
}

impl fmt::Display for ShapeSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ConfigJson(p) => write!(f, "{}", p.display()),
            Self::Gguf(p) => write!(f, "{} (GGUF metadata)", p.display()),
            Self::Known(id) => write!(f, "dflash's table of known models ({id})"),
        }
    }
}

/// The dimensions of a decoder-only transformer (Llama / Qwen family).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelShape {
    /// `model_type` / `general.architecture` (`qwen3`, `llama`, ...).
    pub family: String,
    /// Hidden size.
    pub hidden: u64,
    /// Decoder layers.
    pub layers: u64,
    /// MLP intermediate size.
    pub ffn: u64,
    /// Query heads.
    pub heads: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Per-head dimension.
    pub head_dim: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Whether the LM head shares the embedding's weights.
    pub tied_embeddings: bool,
    /// Exact parameter count when the source lists its tensors (GGUF); otherwise computed.
    pub exact_parameters: Option<u64>,
    /// A hybrid's Gated DeltaNet layers (Qwen3.5); `None` when every layer is attention.
    pub linear: Option<LinearLayers>,
    /// Mixture-of-experts MLPs (then `ffn` is one expert's width); `None` for dense MLPs.
    pub experts: Option<Experts>,
    /// Where this came from.
    pub source: ShapeSource,
}

/// The Gated DeltaNet layers of a hybrid target (Qwen3.5 / Qwen3.6): how many, and their
/// widths. Its attention layers are gated (their query projection is twice as wide).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LinearLayers {
    /// Gated DeltaNet layers (the rest are full attention).
    pub count: u64,
    /// Query/key heads.
    pub key_heads: u64,
    /// Value heads.
    pub value_heads: u64,
    /// Per-head query/key width.
    pub key_dim: u64,
    /// Per-head value width.
    pub value_dim: u64,
    /// The causal convolution's kernel.
    pub kernel: u64,
}

impl LinearLayers {
    fn conv_dim(&self) -> u64 {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// One layer's mixing weights (projections, convolution, gates; not the MLP).
    fn mixer_parameters(&self, hidden: u64) -> u64 {
        let value_width = self.value_heads * self.value_dim;
        hidden * self.conv_dim()          // in_proj_qkv
            + hidden * value_width        // in_proj_z
            + 2 * hidden * self.value_heads // in_proj_a, in_proj_b
            + value_width * hidden        // out_proj
            + self.conv_dim() * self.kernel
            + 2 * self.value_heads        // A_log, dt_bias
            + self.value_dim // the gated norm
    }

    /// Bytes of one sequence's state in one layer (f32 recurrence, bf16 convolution window):
    /// the same at any context length.
    pub fn state_bytes(&self) -> u64 {
        4 * self.value_heads * self.key_dim * self.value_dim
            + 2 * (self.kernel - 1) * self.conv_dim()
    }
}

/// A mixture-of-experts MLP's shape (Qwen3.5-MoE): routed experts plus one shared expert.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Experts {
    /// Routed experts per layer.
    pub count: u64,
    /// Experts each token goes to.
    pub per_token: u64,
    /// The shared expert's width.
    pub shared_ffn: u64,
}

/// Hub ids dflash knows the shape of, from their published `config.json` files:
/// (id, family, hidden, layers, ffn, heads, kv heads, head dim, vocab, tied).
type Known = (
    &'static str,
    &'static str,
    u64,
    u64,
    u64,
    u64,
    u64,
    u64,
    u64,
    bool,
);
const KNOWN: &[Known] = &[
    (
        "Qwen/Qwen3-0.6B",
        "qwen3",
        1024,
        28,
        3072,
        16,
        8,
        128,
        151_936,
        true,
    ),
    (
        "Qwen/Qwen3-1.7B",
        "qwen3",
        2048,
        28,
        6144,
        16,
        8,
        128,
        151_936,
        true,
    ),
    (
        "Qwen/Qwen3-4B",
        "qwen3",
        2560,
        36,
        9728,
        32,
        8,
        128,
        151_936,
        true,
    ),
    (
        "Qwen/Qwen3-8B",
        "qwen3",
        4096,
        36,
        12288,
        32,
        8,
        128,
        151_936,
        false,
    ),
    (
        "Qwen/Qwen3-14B",
        "qwen3",
        5120,
        40,
        17408,
        40,
        8,
        128,
        151_936,
        false,
    ),
    (
        "Qwen/Qwen3-32B",
        "qwen3",
        5120,
        64,
        25600,
        64,
        8,
        128,
        151_936,
        false,
    ),
    (
        "meta-llama/Llama-3.1-8B",
        "llama",
        4096,
        32,
        14336,
        32,
        8,
        128,
        128_256,
        false,
    ),
    (
        "meta-llama/Llama-3.1-8B-Instruct",
        "llama",
        4096,
        32,
        14336,
        32,
        8,
        128,
        128_256,
        false,
    ),
    (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "llama",
        576,
        30,
        1536,
        9,
        3,
        64,
        49_152,
        true,
    ),
    (
        "HuggingFaceTB/SmolLM2-360M-Instruct",
        "llama",
        960,
        32,
        2560,
        15,
        5,
        64,
        49_152,
        true,
    ),
];

impl ModelShape {
    /// Find the shape of `reference`: a local model folder (its `config.json`), a `config.json`
    /// file, a `.gguf` file, or a Hub id in dflash's table. Relative paths resolve against `base`.
    pub fn locate(reference: &str, base: &Path) -> Result<Self, StageError> {
        let path = base.join(reference);
        if path.is_dir() {
            let config = path.join("config.json");
            if config.is_file() {
                return Self::from_config_json(&config);
            }
            return Err(StageError::new(format!(
                "the model folder `{}` has no `config.json`",
                path.display()
            ))
            .with_help("copy the model's `config.json` into it, or give a `.gguf` file"));
        }
        if path.is_file() {
            if reference.ends_with(".gguf") {
                return Self::from_gguf_cached(&path);
            }
            return Self::from_config_json(&path);
        }
        if let Some(k) = known(reference) {
            return Ok(k);
        }
        Err(StageError::new(format!(
            "dflash does not know the shape of the model `{reference}`"
        ))
        .with_help(format!(
            "point it at a local folder holding the model's `config.json` (or a `.gguf` file); \
             models dflash knows by Hub id: {}",
            KNOWN.iter().map(|k| k.0).collect::<Vec<_>>().join(", ")
        )))
    }

    /// Read a Hugging Face `config.json` (a multimodal config's `text_config` is used when present).
    pub fn from_config_json(path: &Path) -> Result<Self, StageError> {
        let shown = path.display();
        let text = std::fs::read_to_string(path)
            .map_err(|e| StageError::new(format!("cannot read `{shown}`: {e}")))?;
        let doc: Value = serde_json::from_str(&text)
            .map_err(|e| StageError::new(format!("`{shown}` is not valid JSON: {e}")))?;
        let c = doc
            .get("text_config")
            .filter(|v| v.is_object())
            .unwrap_or(&doc);
        let int = |key: &str| c.get(key).and_then(Value::as_u64);
        let need = |key: &str| {
            int(key).filter(|&v| v > 0).ok_or_else(|| {
                StageError::new(format!("`{shown}` has no positive integer `{key}`"))
                    .with_help("is this a decoder-only transformer's config.json?")
            })
        };
        let hidden = need("hidden_size")?;
        let heads = need("num_attention_heads")?;
        let layers = need("num_hidden_layers")?;
        let experts = match (
            int("num_experts").or_else(|| int("num_local_experts")),
            int("num_experts_per_tok"),
        ) {
            (Some(count), Some(per_token)) if count > 0 && per_token > 0 => Some(Experts {
                count,
                per_token,
                shared_ffn: int("shared_expert_intermediate_size").unwrap_or(0),
            }),
            _ => None,
        };
        let ffn = if experts.is_some() {
            need("moe_intermediate_size")?
        } else {
            need("intermediate_size")?
        };
        // Hybrids name each layer's type, or say every how many layers one is full attention.
        let linear = match (int("linear_num_value_heads"), c.get("layer_types")) {
            (Some(value_heads), types) => {
                let count = match types.and_then(Value::as_array) {
                    Some(t) => t
                        .iter()
                        .filter(|x| x.as_str() == Some("linear_attention"))
                        .count() as u64,
                    None => {
                        let every = int("full_attention_interval").unwrap_or(4).max(1);
                        (0..layers).filter(|i| (i + 1) % every != 0).count() as u64
                    }
                };
                Some(LinearLayers {
                    count,
                    key_heads: int("linear_num_key_heads").unwrap_or(value_heads),
                    value_heads,
                    key_dim: int("linear_key_head_dim").unwrap_or(128),
                    value_dim: int("linear_value_head_dim").unwrap_or(128),
                    kernel: int("linear_conv_kernel_dim").unwrap_or(4),
                })
            }
            (None, _) => None,
        };
        Ok(Self {
            family: c
                .get("model_type")
                .and_then(Value::as_str)
                .unwrap_or("unknown")
                .to_owned(),
            hidden,
            layers,
            ffn,
            heads,
            kv_heads: int("num_key_value_heads").unwrap_or(heads),
            head_dim: int("head_dim").unwrap_or(hidden / heads),
            vocab: need("vocab_size")?,
            tied_embeddings: c
                .get("tie_word_embeddings")
                .or_else(|| doc.get("tie_word_embeddings"))
                .and_then(Value::as_bool)
                .unwrap_or(false),
            exact_parameters: None,
            linear,
            experts,
            source: ShapeSource::ConfigJson(path.to_owned()),
        })
    }

    /// [`Self::from_gguf`], read once per file (and size and modification time) in this
    /// process: `dflash plan` checks every stage that names the target, often several.
    fn from_gguf_cached(path: &Path) -> Result<Self, StageError> {
        type Seen = HashMap<(PathBuf, u64, Option<SystemTime>), ModelShape>;
        static SEEN: OnceLock<Mutex<Seen>> = OnceLock::new();
        let meta = std::fs::metadata(path)
            .map_err(|e| StageError::new(format!("cannot read `{}`: {e}", path.display())))?;
        let id = (path.to_owned(), meta.len(), meta.modified().ok());
        let seen = SEEN.get_or_init(Mutex::default);
        if let Some(shape) = seen.lock().ok().and_then(|m| m.get(&id).cloned()) {
            return Ok(shape);
        }
        let shape = Self::from_gguf(path)?;
        if let Ok(mut m) = seen.lock() {
            m.insert(id, shape.clone());
        }
        Ok(shape)
    }

    /// Read a GGUF file's metadata and tensor list.
    pub fn from_gguf(path: &Path) -> Result<Self, StageError> {
        let header = gguf::read_shape_header(path)?;
        let m = &header.metadata;
        let shown = path.display();
        let arch = match m.get("general.architecture") {
            Some(Meta::Str(a)) => a.clone(),
            _ => {
                return Err(StageError::new(format!(
                    "`{shown}` has no `general.architecture`"
                )));
            }
        };
        let int = |key: &str| match m.get(&format!("{arch}.{key}")) {
            Some(Meta::Int(i)) => u64::try_from(*i).ok().filter(|&v| v > 0),
            _ => None,
        };
        let need = |key: &str| {
            int(key)
                .ok_or_else(|| StageError::new(format!("`{shown}` has no positive `{arch}.{key}`")))
        };
        let hidden = need("embedding_length")?;
        let heads = need("attention.head_count")?;
        // The embedding table's rows are the vocabulary the model computes with (innermost
        // dimension first in GGUF: [hidden, vocab]); the metadata says the same when present.
        let embedding_rows = header
            .tensors
            .iter()
            .find(|(n, _)| n == "token_embd.weight")
            .and_then(|(_, dims)| dims.get(1).copied());
        let vocab = embedding_rows
            .or_else(|| int("vocab_size"))
            .or_else(|| match m.get("tokenizer.ggml.tokens") {
                Some(Meta::Strs(t)) => Some(t.len() as u64),
                Some(Meta::Skipped(n)) => Some(*n),
                _ => None,
            })
            .ok_or_else(|| StageError::new(format!("`{shown}` says nothing of its vocabulary")))?;
        // llama.cpp's Qwen3-MoE (`qwen3moe`): routed experts, no shared one; `ffn` is then one
        // expert's width, as for a Hugging Face config.
        let experts = match (int("expert_count"), int("expert_used_count")) {
            (Some(count), Some(per_token)) => Some(Experts {
                count,
                per_token,
                shared_ffn: 0,
            }),
            _ => None,
        };
        let ffn = if experts.is_some() {
            need("expert_feed_forward_length")?
        } else {
            need("feed_forward_length")?
        };
        Ok(Self {
            // The Hugging Face `model_type` of the same model.
            family: if arch == "qwen3moe" {
                "qwen3_moe".into()
            } else {
                arch.clone()
            },
            hidden,
            layers: need("block_count")?,
            ffn,
            heads,
            kv_heads: int("attention.head_count_kv").unwrap_or(heads),
            head_dim: int("attention.key_length").unwrap_or(hidden / heads),
            vocab,
            tied_embeddings: !header.tensors.iter().any(|(n, _)| n == "output.weight"),
            exact_parameters: Some(header.parameters()),
            linear: None,
            experts,
            source: ShapeSource::Gguf(path.to_owned()),
        })
    }

    /// Query width (`heads x head_dim`).
    pub fn attention_width(&self) -> u64 {
        self.heads * self.head_dim
    }

    /// Weights of one decoder layer's matrices (attention and MLP; the norms excluded); a
    /// mixture of experts counts the experts one token uses (what its FLOPs scale with).
    pub fn layer_matmul_parameters(&self) -> u64 {
        let h = self.hidden;
        let q = self.attention_width();
        let kv = self.kv_heads * self.head_dim;
        let attention = h * q + 2 * h * kv + q * h;
        attention + self.mlp_parameters(true)
    }

    /// One layer's MLP weights: all of them, or (`active`) those one token uses.
    fn mlp_parameters(&self, active: bool) -> u64 {
        let h = self.hidden;
        match &self.experts {
            None => 3 * h * self.ffn,
            Some(e) => {
                let routed = if active { e.per_token } else { e.count };
                // The router, and a shared expert with its scale where there is one.
                let shared = if e.shared_ffn > 0 {
                    3 * h * e.shared_ffn + h
                } else {
                    0
                };
                routed * 3 * h * self.ffn + e.count * h + shared
            }
        }
    }

    /// Weights of one decoder layer, norms included (QK-norm for Qwen3).
    pub fn layer_parameters(&self) -> u64 {
        let qk_norm = if self.family.starts_with("qwen3") {
            2 * self.head_dim
        } else {
            0
        };
        self.layer_matmul_parameters() + 2 * self.hidden + qk_norm
    }

    /// Full-attention layers (all of them but a hybrid's Gated DeltaNet layers).
    pub fn attention_layers(&self) -> u64 {
        self.layers - self.linear.as_ref().map_or(0, |l| l.count)
    }

    /// The matrices' weights over all layers: a hybrid's attention layers have a gate as wide
    /// as their queries, its Gated DeltaNet layers their own projections.
    pub fn target_matmul_parameters(&self) -> u64 {
        let gate = if self.linear.is_some() {
            self.hidden * self.attention_width()
        } else {
            0
        };
        let attention = self.attention_layers() * (self.layer_matmul_parameters() + gate);
        let linear = self.linear.as_ref().map_or(0, |l| {
            l.count * (l.mixer_parameters(self.hidden) + self.mlp_parameters(true))
        });
        attention + linear
    }

    /// All weights: the exact count when the source lists tensors, else from the dimensions.
    pub fn parameters(&self) -> u64 {
        self.exact_parameters.unwrap_or_else(|| {
            let embedding = self.vocab * self.hidden;
            let head = if self.tied_embeddings { 0 } else { embedding };
            let norms = self.layers * 2 * self.hidden
                + if self.family.starts_with("qwen3") {
                    self.attention_layers() * 2 * self.head_dim
                } else {
                    0
                };
            // Every expert's weights are held, not only the ones a token uses.
            let idle = self.layers * (self.mlp_parameters(false) - self.mlp_parameters(true));
            self.target_matmul_parameters() + idle + norms + embedding + head + self.hidden
        })
    }

    /// FLOPs of one causal forward pass over a sequence of `tokens`, up to the last layer's
    /// output (no LM head: online training only needs the hidden states). Matmuls count
    /// 2 FLOPs per multiply-add; attention scores and values over the causal half, in the
    /// full-attention layers only; a Gated DeltaNet layer's recurrence is linear in the tokens
    /// (chunks of 64: the within-chunk products and the state's read and write).
    pub fn forward_flops(&self, tokens: f64) -> f64 {
        let matmuls = 2.0 * self.target_matmul_parameters() as f64 * tokens;
        let attention =
            2.0 * self.attention_layers() as f64 * self.attention_width() as f64 * tokens * tokens;
        let recurrence = self.linear.as_ref().map_or(0.0, |l| {
            let per_head = 2.0 * 64.0 * (l.key_dim + l.value_dim) as f64
                + 6.0 * (l.key_dim * l.value_dim) as f64;
            l.count as f64 * l.value_heads as f64 * per_head * tokens
        });
        matmuls + attention + recurrence
    }

    /// Bytes one sequence keeps while decoding at `tokens` of context, in bf16: keys and values
    /// of the attention layers, per token; a hybrid's Gated DeltaNet state, per layer.
    pub fn decode_state_bytes(&self, tokens: u64) -> u64 {
        let kv = 2 * 2 * self.kv_heads * self.head_dim * self.attention_layers() * tokens;
        kv + self
            .linear
            .as_ref()
            .map_or(0, |l| l.count * l.state_bytes())
    }

    /// FLOPs of the LM head for one position (2 x hidden x vocab).
    pub fn lm_head_flops(&self) -> f64 {
        2.0 * (self.hidden * self.vocab) as f64
    }

    /// Bytes of one token's hidden state at one layer, in bf16.
    pub fn hidden_state_bytes(&self) -> u64 {
        2 * self.hidden
    }
}

fn known(reference: &str) -> Option<ModelShape> {
    let wanted = reference.trim_end_matches('/').to_ascii_lowercase();
    KNOWN
        .iter()
        .find(|k| {
            let id = k.0.to_ascii_lowercase();
            id == wanted || id.rsplit('/').next() == Some(wanted.as_str())
        })
        .map(
            |&(id, family, hidden, layers, ffn, heads, kv_heads, head_dim, vocab, tied)| {
                ModelShape {
                    family: family.into(),
                    hidden,
                    layers,
                    ffn,
                    heads,
                    kv_heads,
                    head_dim,
                    vocab,
                    tied_embeddings: tied,
                    exact_parameters: None,
                    linear: None,
                    experts: None,
                    source: ShapeSource::Known(id.into()),
                }
            },
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen3_8b_counts_match_its_published_size_and_the_measured_flops() {
        let q = ModelShape::locate("Qwen/Qwen3-8B", Path::new(".")).unwrap();
        // Qwen3-8B is published as 8.2B parameters.
        let p = q.parameters() as f64 / 1e9;
        assert!((8.1..8.3).contains(&p), "{p}");
        // DFLASH.md: 45.5 TFLOPs for one 3072-token target forward.
        let f = q.forward_flops(3072.0) / 1e12;
        assert!((45.0..46.0).contains(&f), "{f}");
    }

    #[test]
    fn config_json_and_its_text_config_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = r#"{"model_type": "x", "text_config": {"model_type": "qwen3", "hidden_size": 64,
            "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 1000}}"#;
        std::fs::write(dir.path().join("config.json"), cfg).unwrap();
        let s = ModelShape::locate(".", dir.path()).unwrap();
        assert_eq!(
            (s.family.as_str(), s.head_dim, s.kv_heads),
            ("qwen3", 16, 2)
        );
        assert!(!s.tied_embeddings);
    }

    /// Qwen3.5-27B's published config: 64 layers, 48 of them Gated DeltaNet; 27B parameters.
    #[test]
    fn a_hybrid_config_counts_its_linear_layers_and_their_state() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = r#"{"model_type": "qwen3_5", "tie_word_embeddings": false, "text_config": {
            "model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64,
            "intermediate_size": 17408, "num_attention_heads": 24, "num_key_value_heads": 4,
            "head_dim": 256, "vocab_size": 248320, "full_attention_interval": 4,
            "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}}"#;
        std::fs::write(dir.path().join("config.json"), cfg).unwrap();
        let s = ModelShape::locate(".", dir.path()).unwrap();
        let l = s.linear.clone().unwrap();
        assert_eq!((l.count, s.attention_layers()), (48, 16));
        let p = s.parameters() as f64 / 1e9;
        assert!((26.0..28.5).contains(&p), "{p}");
        // A Gated DeltaNet layer's state does not grow with the context; attention's does.
        let grows = s.decode_state_bytes(8192) - s.decode_state_bytes(4096);
        assert_eq!(grows, 2 * 2 * 4 * 256 * 16 * 4096);
        assert_eq!(s.decode_state_bytes(0), 48 * l.state_bytes());
    }

    #[test]
    fn an_unknown_id_names_what_is_known() {
        let e = ModelShape::locate("acme/Giant-1T", Path::new(".")).unwrap_err();
        assert!(e.to_string().contains("acme/Giant-1T"));
        assert!(e.help.unwrap().contains("Qwen/Qwen3-8B"));
    }
}
