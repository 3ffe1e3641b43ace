//! The tokenizer and chat template of a model: from a Hugging Face model folder
//! (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`)
//! or from a GGUF file's metadata (see `gguf`).

use std::path::{Path, PathBuf};

use dflash_stage_api::{Pin, StageError, remote};
use serde_json::{Map, Value as Json};
use tokenizers::Tokenizer;

use crate::bpe::FastBpe;
use crate::gguf;

/// The `tokenizers` tokenizer (built by `hf`) and the fast path for `spec`, built in parallel
/// (each takes a few hundred milliseconds for a 150K vocabulary).
pub(crate) fn both_paths(
    spec: &Json,
    hf: impl FnOnce() -> Result<Tokenizer, StageError>,
) -> Result<(Tokenizer, Option<FastBpe>), StageError> {
    std::thread::scope(|s| {
        let fast = s.spawn(|| FastBpe::from_json(spec));
        let tokenizer = hf()?;
        Ok((tokenizer, fast.join().ok().flatten()))
    })
}

/// What tokenization needs from a model.
pub struct Model {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The fast path for it, when its shape allows (see `bpe`).
    pub fast: Option<FastBpe>,
    /// The chat template source.
    pub template: String,
    /// Special tokens as templates see them (`bos_token`, `eos_token`, ...).
    pub special: Map<String, Json>,
    /// Strings that end an assistant turn (end-of-sequence and end-of-turn tokens).
    pub end_tokens: Vec<String>,
}

/// The files of a model folder that decide tokenization: the tokenizer, its config, the
/// template and the generation config (its end tokens).
const FOLDER_FILES: [&str; 4] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
];

/// The local files that decide tokenization, for pinning: those of a folder, or the GGUF file.
pub fn identity_files(path: &Path) -> Vec<PathBuf> {
    if path.is_file() {
        return vec![path.to_owned()];
    }
    FOLDER_FILES
        .iter()
        .map(|f| path.join(f))
        .filter(|p| p.is_file())
        .collect()
}

/// Whether a name ends in `.gguf` (any case).
pub fn is_gguf(name: &str) -> bool {
    Path::new(name)
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The objects a remote model may hold, as (file name, URL): the folder's files under the
/// prefix, or the `.gguf` object itself.
pub fn remote_files(url: &str) -> Vec<(String, String)> {
    if is_gguf(url) {
        let name = url.rsplit('/').next().unwrap_or("model.gguf").to_owned();
        return vec![(name, url.to_owned())];
    }
    let base = url.trim_end_matches('/');
    FOLDER_FILES
        .iter()
        .map(|f| ((*f).to_owned(), format!("{base}/{f}")))
        .collect()
}

/// Bring the remote model at `url` into `dir`, exactly the versions `pins` name (each object
/// is checked again after the copy, so one replaced meanwhile fails the stage instead of
/// tokenizing with other files than the key says). Returns the local model path.
pub fn fetch_remote(url: &str, pins: &[Pin], dir: &Path) -> Result<PathBuf, StageError> {
    std::fs::create_dir_all(dir)?;
    let mut local = dir.to_owned();
    for (name, object) in remote_files(url) {
        let Some(pin) = pins.iter().find(|p| p.name == format!("tokenizer:{name}")) else {
            continue;
        };
        let dest = dir.join(&name);
        remote::fetch(&object, &dest)?;
        if remote::identity(&object)?.as_deref() != Some(pin.identity.as_str()) {
            return Err(StageError::new(format!(
                "`{}` changed while the stage ran",
                remote::shown(&object)
            ))
            .with_help("run again: the new version gets its own key"));
        }
        if is_gguf(&name) {
            local = dest;
        }
    }
    Ok(local)
}

fn read_json(path: &Path) -> Result<Option<Json>, StageError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| StageError::new(format!("`{}` is not valid JSON: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(StageError::new(format!(
            "cannot read `{}`: {e}",
            path.display()
        ))),
    }
}

/// A special token as `tokenizer_config.json` spells it: a string or `{"content": ...}`.
fn token_text(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

/// Load the model at `path` (a folder or a `.gguf` file). `template` overrides its chat template.
pub fn load(path: &Path, template: Option<String>) -> Result<Model, StageError> {
    if path.is_file() {
        let g = gguf::load(path)?;
        let template = template.or(g.template).ok_or_else(|| {
            StageError::new(format!("`{}` has no chat template", path.display()))
                .with_help("set `chat_template:` to a template file")
        })?;
        return Ok(Model {
            tokenizer: g.tokenizer,
            fast: g.fast,
            template,
            special: g.special,
            end_tokens: g.end_tokens,
        });
    }
    if !path.is_dir() {
        return Err(
            StageError::new(format!("the tokenizer `{}` does not exist", path.display()))
                .with_help("give a model folder holding `tokenizer.json`, or a `.gguf` file"),
        );
    }
    let tok_path = path.join("tokenizer.json");
    if !tok_path.is_file() {
        return Err(
            StageError::new(format!("`{}` has no `tokenizer.json`", path.display())).with_help(
                "dflash reads fast tokenizers (`tokenizer.json`); or give a `.gguf` file",
            ),
        );
    }
    let spec = read_json(&tok_path)?.unwrap_or(Json::Null);
    let (tokenizer, fast) = both_paths(&spec, || {
        Tokenizer::from_file(&tok_path)
            .map_err(|e| StageError::new(format!("cannot load `{}`: {e}", tok_path.display())))
    })?;
    let config = read_json(&path.join("tokenizer_config.json"))?.unwrap_or(Json::Null);
    let mut special = Map::new();
    for name in [
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "sep_token",
        "cls_token",
        "mask_token",
    ] {
        if let Some(t) = config.get(name).and_then(token_text) {
            special.insert(name.into(), Json::String(t));
        }
    }
    if let Some(extra) = config
        .get("additional_special_tokens")
        .and_then(Json::as_array)
    {
        let list: Vec<Json> = extra
            .iter()
            .filter_map(token_text)
            .map(Json::String)
            .collect();
        special.insert("additional_special_tokens".into(), Json::Array(list));
    }

    let template = match template {
        Some(t) => t,
        None => find_template(path, &config)?,
    };

    let mut end_tokens: Vec<String> = special
        .get("eos_token")
        .and_then(Json::as_str)
        .map(str::to_owned)
        .into_iter()
        .collect();
    if let Some(generation) = read_json(&path.join("generation_config.json"))? {
        let ids: Vec<u64> = match generation.get("eos_token_id") {
            Some(Json::Number(n)) => n.as_u64().into_iter().collect(),
            Some(Json::Array(a)) => a.iter().filter_map(Json::as_u64).collect(),
            _ => Vec::new(),
        };
        for id in ids {
            if let Some(t) = u32::try_from(id)
                .ok()
                .and_then(|id| tokenizer.id_to_token(id))
                && !end_tokens.contains(&t)
            {
                end_tokens.push(t);
            }
        }
    }
    Ok(Model {
        tokenizer,
        fast,
        template,
        special,
        end_tokens,
    })
}

/// The template a folder holds: `chat_template.jinja` (the newer layout, which `transformers`
/// prefers), else `chat_template` in `tokenizer_config.json` (a string, or a list of named
/// templates of which `default` is used).
fn find_template(dir: &Path, config: &Json) -> Result<String, StageError> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        return std::fs::read_to_string(&jinja)
            .map_err(|e| StageError::new(format!("cannot read `{}`: {e}", jinja.display())));
    }
    match config.get("chat_template") {
        Some(Json::String(s)) => Ok(s.clone()),
        Some(Json::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template").and_then(Json::as_str))
            .map(str::to_owned)
            .ok_or_else(|| {
                StageError::new(format!(
                    "`{}` lists chat templates but none is named `default`",
                    dir.join("tokenizer_config.json").display()
                ))
                .with_help("set `chat_template:` to the template file to use")
            }),
        _ => Err(StageError::new(format!(
            "`{}` has no chat template (no `chat_template.jinja`, none in `tokenizer_config.json`)",
            dir.display()
        ))
        .with_help("set `chat_template:` to a template file")),
    }
}
