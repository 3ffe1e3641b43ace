//! The token dataset `tokenize` writes: Arrow IPC stream files (`<split>-<nnnnn>.arrow`, the
//! layout of the conversation dataset) that pyarrow and Hugging Face `datasets` read directly.
//!
//! Columns: `id` and `source` (of the conversation), `input_ids` (list of int32), `loss_mask`
//! (list of int8: 1 where the model generated the token) and `length` (int32). The schema
//! carries `dflash.schema = tokens/1`.

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{Int8Builder, Int32Builder, ListBuilder, StringBuilder};
use arrow_array::{ArrayRef, Int32Array, RecordBatch};
use arrow_ipc::writer::StreamWriter;
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use dflash_stage_api::StageError;

/// The schema version written into every file's metadata.
pub const SCHEMA_VERSION: &str = "tokens/1";

/// One tokenized row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// The conversation's id.
    pub id: String,
    /// The conversation's source.
    pub source: String,
    /// Token ids.
    pub input_ids: Vec<i32>,
    /// 1 where the model generated the token.
    pub loss_mask: Vec<i8>,
}

/// The token schema.
pub fn schema() -> SchemaRef {
    let meta: std::collections::HashMap<String, String> =
        [("dflash.schema".to_owned(), SCHEMA_VERSION.to_owned())].into();
    let list = |t: DataType| DataType::List(Arc::new(Field::new("item", t, true)));
    Arc::new(Schema::new_with_metadata(
        vec![
            Field::new("id", DataType::Utf8, false),
            Field::new("source", DataType::Utf8, false),
            Field::new("input_ids", list(DataType::Int32), false),
            Field::new("loss_mask", list(DataType::Int8), false),
            Field::new("length", DataType::Int32, false),
        ],
        meta,
    ))
}

fn batch(rows: &[Row]) -> RecordBatch {
    let tokens: usize = rows.iter().map(|r| r.input_ids.len()).sum();
    let mut id = StringBuilder::new();
    let mut source = StringBuilder::new();
    let mut ids = ListBuilder::new(Int32Builder::with_capacity(tokens));
    let mut mask = ListBuilder::new(Int8Builder::with_capacity(tokens));
    let mut length = Vec::with_capacity(rows.len());
    for r in rows {
        id.append_value(&r.id);
        source.append_value(&r.source);
        ids.values().append_slice(&r.input_ids);
        ids.append(true);
        mask.values().append_slice(&r.loss_mask);
        mask.append(true);
        length.push(i32::try_from(r.input_ids.len()).unwrap_or(i32::MAX));
    }
    let columns: Vec<ArrayRef> = vec![
        Arc::new(id.finish()),
        Arc::new(source.finish()),
        Arc::new(ids.finish()),
        Arc::new(mask.finish()),
        Arc::new(Int32Array::from(length)),
    ];
    RecordBatch::try_new(schema(), columns).expect("columns match the schema")
}

/// A new token file, written batch by batch.
pub struct Writer {
    path: PathBuf,
    inner: StreamWriter<BufWriter<File>>,
}

impl Writer {
    /// Create `path`; refuses to replace an existing file.
    pub fn create(path: &Path) -> Result<Self, StageError> {
        let err = |e: &dyn std::fmt::Display| {
            StageError::new(format!("cannot write `{}`: {e}", path.display()))
        };
        let file = File::create_new(path).map_err(|e| err(&e))?;
        let inner = StreamWriter::try_new(BufWriter::new(file), &schema()).map_err(|e| err(&e))?;
        Ok(Self {
            path: path.to_owned(),
            inner,
        })
    }

    /// Append rows as one record batch.
    pub fn write(&mut self, rows: &[Row]) -> Result<(), StageError> {
        if rows.is_empty() {
            return Ok(());
        }
        self.inner
            .write(&batch(rows))
            .map_err(|e| StageError::new(format!("cannot write `{}`: {e}", self.path.display())))
    }

    /// Finish the file.
    pub fn finish(mut self) -> Result<(), StageError> {
        self.inner
            .finish()
            .map_err(|e| StageError::new(format!("cannot write `{}`: {e}", self.path.display())))
    }
}
