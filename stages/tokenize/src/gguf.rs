//! The tokenizer and chat template stored in a GGUF file's metadata (llama.cpp's format).
//!
//! A GGUF holds no `tokenizer.json`: it stores the vocabulary (`tokenizer.ggml.tokens`), the
//! token types, the BPE merges, the special token ids, the name of the pre-tokenizer
//! (`tokenizer.ggml.pre`) and `tokenizer.chat_template`. We read only the metadata (never the
//! tensors) and rebuild the byte-level BPE tokenizer the way llama.cpp splits text for that
//! pre-tokenizer name, so the ids match what a llama.cpp server produces.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use dflash_stage_api::StageError;
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

/// A metadata value, as far as tokenization needs it.
#[derive(Debug)]
enum Meta {
    Int(i64),
    Str(String),
    Strs(Vec<String>),
    Ints(Vec<i64>),
    Other,
}

const MAGIC: &[u8; 4] = b"GGUF";
/// Metadata arrays longer than this are refused (a corrupt length would allocate forever).
const MAX_ARRAY: u64 = 1 << 26;
const MAX_STRING: u64 = 1 << 28;

struct Reader<R> {
    inner: R,
}

impl<R: Read> Reader<R> {
    fn bytes<const N: usize>(&mut self) -> std::io::Result<[u8; N]> {
        let mut b = [0u8; N];
        self.inner.read_exact(&mut b)?;
        Ok(b)
    }
    fn u32(&mut self) -> std::io::Result<u32> {
        self.bytes::<4>().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> std::io::Result<u64> {
        self.bytes::<8>().map(u64::from_le_bytes)
    }
    fn string(&mut self) -> std::io::Result<String> {
        let len = self.u64()?;
        if len > MAX_STRING {
            return Err(invalid("a string longer than 256 MiB"));
        }
        let mut buf = vec![0u8; len as usize];
        self.inner.read_exact(&mut buf)?;
        String::from_utf8(buf).map_err(|_| invalid("a string that is not UTF-8"))
    }

    /// One value of GGUF type `ty`; integers widen to i64, floats and bools are skipped.
    fn scalar(&mut self, ty: u32) -> std::io::Result<Meta> {
        Ok(match ty {
            0 => Meta::Int(i64::from(self.bytes::<1>()?[0])),
            1 => Meta::Int(i64::from(i8::from_le_bytes(self.bytes::<1>()?))),
            2 => Meta::Int(i64::from(u16::from_le_bytes(self.bytes::<2>()?))),
            3 => Meta::Int(i64::from(i16::from_le_bytes(self.bytes::<2>()?))),
            4 => Meta::Int(i64::from(self.u32()?)),
            5 => Meta::Int(i64::from(i32::from_le_bytes(self.bytes::<4>()?))),
            6 => {
                self.bytes::<4>()?;
                Meta::Other
            }
            7 => {
                self.bytes::<1>()?;
                Meta::Other
            }
            8 => Meta::Str(self.string()?),
            10 => Meta::Int(i64::try_from(self.u64()?).unwrap_or(i64::MAX)),
            11 => Meta::Int(i64::from_le_bytes(self.bytes::<8>()?)),
            12 => {
                self.bytes::<8>()?;
                Meta::Other
            }
            _ => return Err(invalid(&format!("an unknown value type {ty}"))),
        })
    }

    fn value(&mut self, ty: u32) -> std::io::Result<Meta> {
        if ty != 9 {
            return self.scalar(ty);
        }
        let item = self.u32()?;
        let len = self.u64()?;
        if len > MAX_ARRAY {
            return Err(invalid("an array longer than 64M items"));
        }
        let len = len as usize;
        match item {
            8 => (0..len)
                .map(|_| self.string())
                .collect::<Result<_, _>>()
                .map(Meta::Strs),
            9 => Err(invalid("nested arrays")),
            _ => {
                let mut ints = Vec::with_capacity(len);
                for _ in 0..len {
                    if let Meta::Int(i) = self.scalar(item)? {
                        ints.push(i);
                    }
                }
                Ok(if ints.len() == len {
                    Meta::Ints(ints)
                } else {
                    Meta::Other
                })
            }
        }
    }
}

fn invalid(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned())
}

fn read_metadata(path: &Path) -> Result<BTreeMap<String, Meta>, StageError> {
    let err = |e: std::io::Error| {
        StageError::new(format!(
            "cannot read GGUF metadata of `{}`: {e}",
            path.display()
        ))
    };
    let file = File::open(path).map_err(err)?;
    let mut r = Reader {
        inner: BufReader::with_capacity(1 << 20, file),
    };
    let magic = r.bytes::<4>().map_err(err)?;
    if &magic != MAGIC {
        return Err(StageError::new(format!(
            "`{}` is neither a model folder nor a GGUF file",
            path.display()
        ))
        .with_help("give a folder holding `tokenizer.json`, or a `.gguf` file"));
    }
    let version = r.u32().map_err(err)?;
    if !(2..=3).contains(&version) {
        return Err(StageError::new(format!(
            "`{}` is GGUF version {version}; dflash reads versions 2 and 3",
            path.display()
        )));
    }
    let _tensors = r.u64().map_err(err)?;
    let count = r.u64().map_err(err)?;
    let mut out = BTreeMap::new();
    for _ in 0..count {
        let key = r.string().map_err(err)?;
        let ty = r.u32().map_err(err)?;
        let value = r.value(ty).map_err(err)?;
        out.insert(key, value);
    }
    Ok(out)
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
