//! Reading the token files `tokenize` writes (`<split>-NNNNN.arrow`, Arrow IPC streams with
//! `input_ids` int32 and `loss_mask` int8 list columns), for the stages that consume them.

use std::path::{Path, PathBuf};

use arrow_array::{Array, Int8Array, Int32Array, ListArray, StringArray};

use crate::StageError;

/// The file in a tokenize artifact that says how its rows were rendered (`template_kwargs`,
/// end tokens, vocabulary size); `train` copies it beside the drafter as [`TRAINING_FILE`].
pub const RENDERING_FILE: &str = "tokenize.json";

/// The file in a train artifact that says what the drafter was trained against: the target and
/// how its data was rendered, so `bench` can warn when it is served differently.
pub const TRAINING_FILE: &str = "training.json";

/// One tokenized row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenRow {
    /// The row's id (empty when the file has none).
    pub id: String,
    /// Token ids.
    pub ids: Vec<u32>,
    /// 1 where the token is trained on.
    pub mask: Vec<i8>,
}

impl TokenRow {
    /// The prompt: the tokens before the first trained one (the whole row when none is).
    pub fn prompt(&self) -> &[u32] {
        let end = self
            .mask
            .iter()
            .position(|&m| m == 1)
            .unwrap_or(self.ids.len());
        &self.ids[..end]
    }
}

/// Whether `path` is a token file (has an `input_ids` column) rather than a conversation file.
pub fn is_token_file(path: &Path) -> Result<bool, StageError> {
    let file = std::io::BufReader::new(std::fs::File::open(path)?);
    let reader = arrow_ipc::reader::StreamReader::try_new(file, None)
        .map_err(|e| StageError::new(format!("{}: {e}", path.display())))?;
    Ok(reader.schema().column_with_name("input_ids").is_some())
}

/// The files of `split` under `dir`, in order.
pub fn files(dir: &Path, split: &str) -> Result<Vec<PathBuf>, StageError> {
    let prefix = format!("{split}-");
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with(&prefix) && Path::new(n).extension().is_some_and(|e| e == "arrow")
            })
        })
        .collect();
    files.sort();
    Ok(files)
}

/// Every row of one token file, each cut to `max_length` tokens.
pub fn read(path: &Path, max_length: usize) -> Result<Vec<TokenRow>, StageError> {
    let bad = |e: &dyn std::fmt::Display| StageError::new(format!("{}: {e}", path.display()));
    let file = std::io::BufReader::new(std::fs::File::open(path)?);
    let reader = arrow_ipc::reader::StreamReader::try_new(file, None).map_err(|e| bad(&e))?;
    let mut out = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| bad(&e))?;
        let col = |name: &str| {
            batch
                .column_by_name(name)
                .and_then(|c| c.as_any().downcast_ref::<ListArray>().cloned())
                .ok_or_else(|| {
                    bad(&format!(
                        "no `{name}` list column; token files are what `tokenize` writes"
                    ))
                })
        };
        let (ids, masks) = (col("input_ids")?, col("loss_mask")?);
        let row_ids = batch
            .column_by_name("id")
            .and_then(|c| c.as_any().downcast_ref::<StringArray>().cloned());
        for r in 0..batch.num_rows() {
            let (i, m) = (ids.value(r), masks.value(r));
            let i = i
                .as_any()
                .downcast_ref::<Int32Array>()
                .ok_or_else(|| bad(&"input_ids are not int32"))?;
            let m = m
                .as_any()
                .downcast_ref::<Int8Array>()
                .ok_or_else(|| bad(&"loss_mask is not int8"))?;
            let n = i.len().min(max_length);
            out.push(TokenRow {
                id: row_ids
                    .as_ref()
                    .map(|c| c.value(r).to_owned())
                    .unwrap_or_default(),
                ids: i.values()[..n].iter().map(|&v| v as u32).collect(),
                mask: m.values()[..n].to_vec(),
            });
        }
    }
    Ok(out)
}
