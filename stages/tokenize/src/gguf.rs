//! The tokenizer and chat template stored in a GGUF file's metadata (llama.cpp's format).
//!
//! A GGUF holds no `tokenizer.json`: it stores the vocabulary (`tokenizer.ggml.tokens`), the
//! token types, the BPE merges, the special token ids, the name of the pre-tokenizer
//! (`tokenizer.ggml.pre`) and `tokenizer.chat_template`. We read only the metadata (never the
//! tensors) and rebuild the byte-level BPE tokenizer the way llama.cpp splits text for that
//! pre-tokenizer name, so the ids match what a llama.cpp server produces.

use std::collections::BTreeMap;
use std::path::Path;

use dflash_stage_api::StageError;
use dflash_stage_api::gguf::{Meta, read_metadata};
use serde_json::{Map, Value as Json, json};
use tokenizers::Tokenizer;

use crate::bpe::{FastBpe, LLAMA3, QWEN2};

/// What a GGUF file says about tokenization.
pub struct Gguf {
    /// The rebuilt tokenizer.
    pub tokenizer: Tokenizer,
    /// Its fast path, built alongside.
    pub fast: Option<FastBpe>,
    /// `tokenizer.chat_template`, when present.
    pub template: Option<String>,
    /// `bos_token`, `eos_token`, ... as templates see them.
    pub special: Map<String, Json>,
    /// End-of-sequence and end-of-turn tokens.
    pub end_tokens: Vec<String>,
}

/// The regex llama.cpp splits text with for a pre-tokenizer name, as a `tokenizers`
/// pre-tokenizer (JSON). `None` for names we do not know.
fn pre_tokenizer(pre: &str) -> Option<Json> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |regex: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            byte_level(false),
        ]})
    };
    Some(match pre {
        "default" | "gpt-2" | "gpt2" | "olmo" | "jais" => byte_level(true),
        // Single digits first, then GPT-2's split (llama.cpp's StarCoder family, SmolLM included).
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => {
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]})
        }
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "smaug-bpe" | "dbrx" => split(LLAMA3),
        "qwen2" | "deepseek-r1-qwen" | "megrez" => split(QWEN2),
        _ => return None,
    })
}

/// Load the tokenizer and template from the GGUF file at `path`.
pub fn load(path: &Path) -> Result<Gguf, StageError> {
    let mut meta = read_metadata(path)?;
    let shown = path.display();
    let text = |meta: &BTreeMap<String, Meta>, key: &str| match meta.get(key) {
        Some(Meta::Str(s)) => Some(s.clone()),
        _ => None,
    };
    let model = text(&meta, "tokenizer.ggml.model").unwrap_or_default();
    if model != "gpt2" {
        return Err(StageError::new(format!(
            "`{shown}` has a `{model}` tokenizer; dflash rebuilds byte-level BPE (`gpt2`) tokenizers from GGUF"
        ))
        .with_help("point `tokenizer:` at the model's Hugging Face folder (`tokenizer.json`)"));
    }
    let pre_name = text(&meta, "tokenizer.ggml.pre").unwrap_or_else(|| "default".into());
    let pre = pre_tokenizer(&pre_name).ok_or_else(|| {
        StageError::new(format!(
            "`{shown}` uses the pre-tokenizer `{pre_name}`, which dflash does not know"
        ))
        .with_help("point `tokenizer:` at the model's Hugging Face folder (`tokenizer.json`)")
    })?;
    let Some(Meta::Strs(tokens)) = meta.remove("tokenizer.ggml.tokens") else {
        return Err(StageError::new(format!(
            "`{shown}` has no `tokenizer.ggml.tokens`"
        )));
    };
    let merges = match meta.remove("tokenizer.ggml.merges") {
        Some(Meta::Strs(m)) => m,
        _ => Vec::new(),
    };
    let types = match meta.remove("tokenizer.ggml.token_type") {
        Some(Meta::Ints(t)) => t,
        _ => Vec::new(),
    };
    let id = |meta: &BTreeMap<String, Meta>, key: &str| match meta.get(key) {
        Some(Meta::Int(i)) => usize::try_from(*i).ok().filter(|&i| i < tokens.len()),
        _ => None,
    };

    // Control (3) and user-defined (4) tokens are matched whole before splitting, as llama.cpp
    // does when it parses special tokens; control tokens are special.
    let added: Vec<Json> = types
        .iter()
        .enumerate()
        .filter(|(_, t)| **t == 3 || **t == 4)
        .map(|(i, t)| {
            json!({"id": i, "content": tokens[i], "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": *t == 3})
        })
        .collect();
    let vocab: Map<String, Json> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": merges},
    });
    let (tokenizer, fast) = crate::model::both_paths(&spec, || {
        spec.to_string()
            .parse()
            .map_err(|e| StageError::new(format!("cannot rebuild the tokenizer of `{shown}`: {e}")))
    })?;

    let mut special = Map::new();
    for (name, key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(i) = id(&meta, key) {
            special.insert(name.into(), Json::String(tokens[i].clone()));
        }
    }
    let mut end_tokens = Vec::new();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if let Some(i) = id(&meta, key)
            && !end_tokens.contains(&tokens[i])
        {
            end_tokens.push(tokens[i].clone());
        }
    }
    Ok(Gguf {
        tokenizer,
        fast,
        template: text(&meta, "tokenizer.chat_template"),
        special,
        end_tokens,
    })
}
