//! The canonical conversation dataset that `download`, `mix`, `generate` and `tokenize` pass
//! along: Arrow IPC *stream* files (what Hugging Face `datasets` memory-maps and pyarrow reads
//! directly), one folder per artifact, files named `<split>-<nnnnn>.arrow`.
//!
//! Columns: `id`, `source`, `category` (nullable), `messages` (a list of `{role, content,
//! reasoning, tool_calls}`; `reasoning` and `tool_calls` — OpenAI-style JSON text — are
//! nullable), `tools` (nullable JSON text: the tool definitions the conversation was held
//! with), `metadata` (nullable JSON text of the fields a user chose to keep) and
//! `finish_reason` (nullable; set by `generate`). The schema carries its
//! version as metadata (`dflash.schema`), so a reader can refuse a file it does not understand.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{ListBuilder, StringBuilder, StructBuilder};
use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, ListArray, RecordBatch, StringArray, StructArray};
use arrow_ipc::reader::StreamReader;
use arrow_ipc::writer::StreamWriter;
use arrow_schema::{DataType, Field, Fields, Schema, SchemaRef};

use crate::StageError;

/// The schema version written into every file's metadata.
pub const SCHEMA_VERSION: &str = "conversations/2";

/// Rows per file: large enough that per-file overhead vanishes, small enough that one file is a
/// unit of resumable work.
pub const ROWS_PER_FILE: usize = 100_000;

/// One turn of a conversation.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The visible text.
    pub content: String,
    /// The model's reasoning ("thinking"), kept apart from the content.
    pub reasoning: Option<String>,
    /// The assistant's tool calls, as OpenAI-style JSON text (a list of
    /// `{"type": "function", "function": {"name", "arguments"}}`).
    pub tool_calls: Option<String>,
}

/// One row of a conversation dataset.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Conversation {
    /// Unique within its source.
    pub id: String,
    /// Where it came from (by default the id of the `download` stage that fetched it).
    pub source: String,
    /// A category such as `code` or `math`, when the source says.
    pub category: Option<String>,
    /// The turns, in order.
    pub messages: Vec<Message>,
    /// The tool definitions (JSON text of a list) the conversation was held with.
    pub tools: Option<String>,
    /// Kept fields of the original record, as JSON text.
    pub metadata: Option<String>,
    /// Why generation of the last assistant turn stopped (`stop`, `length`, `error`).
    pub finish_reason: Option<String>,
}

fn message_fields() -> Fields {
    Fields::from(vec![
        Field::new("role", DataType::Utf8, false),
        Field::new("content", DataType::Utf8, false),
        Field::new("reasoning", DataType::Utf8, true),
        Field::new("tool_calls", DataType::Utf8, true),
    ])
}

/// The canonical schema.
pub fn schema() -> SchemaRef {
    let meta: std::collections::HashMap<String, String> =
        [("dflash.schema".to_owned(), SCHEMA_VERSION.to_owned())].into();
    Arc::new(Schema::new_with_metadata(
        vec![
            Field::new("id", DataType::Utf8, false),
            Field::new("source", DataType::Utf8, false),
            Field::new("category", DataType::Utf8, true),
            Field::new(
                "messages",
                DataType::List(Arc::new(Field::new(
                    "item",
                    DataType::Struct(message_fields()),
                    true,
                ))),
                false,
            ),
            Field::new("tools", DataType::Utf8, true),
            Field::new("metadata", DataType::Utf8, true),
            Field::new("finish_reason", DataType::Utf8, true),
        ],
        meta,
    ))
}

fn io_err(path: &Path, what: &str, e: impl std::fmt::Display) -> StageError {
    StageError::new(format!("cannot {what} `{}`: {e}", path.display()))
}

/// Build one record batch from rows.
pub fn to_batch(rows: &[Conversation]) -> RecordBatch {
    let mut id = StringBuilder::new();
    let mut source = StringBuilder::new();
    let mut category = StringBuilder::new();
    let mut tools = StringBuilder::new();
    let mut metadata = StringBuilder::new();
    let mut finish = StringBuilder::new();
    let mut messages = ListBuilder::new(StructBuilder::from_fields(message_fields(), 0));
    for r in rows {
        id.append_value(&r.id);
        source.append_value(&r.source);
        category.append_option(r.category.as_deref());
        tools.append_option(r.tools.as_deref());
        metadata.append_option(r.metadata.as_deref());
        finish.append_option(r.finish_reason.as_deref());
        let s = messages.values();
        for m in &r.messages {
            s.field_builder::<StringBuilder>(0)
                .expect("role")
                .append_value(&m.role);
            s.field_builder::<StringBuilder>(1)
                .expect("content")
                .append_value(&m.content);
            s.field_builder::<StringBuilder>(2)
                .expect("reasoning")
                .append_option(m.reasoning.as_deref());
            s.field_builder::<StringBuilder>(3)
                .expect("tool_calls")
                .append_option(m.tool_calls.as_deref());
            s.append(true);
        }
        messages.append(true);
    }
    let messages = messages.finish();
    // The builder names the list item `item` and marks it nullable, as the schema does.
    let columns: Vec<ArrayRef> = vec![
        Arc::new(id.finish()),
        Arc::new(source.finish()),
        Arc::new(category.finish()),
        Arc::new(messages),
        Arc::new(tools.finish()),
        Arc::new(metadata.finish()),
        Arc::new(finish.finish()),
    ];
    RecordBatch::try_new(schema(), columns).expect("columns match the schema")
}

/// A new dataset file written batch by batch, so a large source never sits in memory whole.
pub struct Writer {
    path: PathBuf,
    inner: StreamWriter<BufWriter<File>>,
    pending: Vec<Conversation>,
    rows: u64,
}

impl Writer {
    /// Create `path`; refuses to replace an existing file.
    pub fn create(path: &Path) -> Result<Self, StageError> {
        let file = File::create_new(path).map_err(|e| io_err(path, "create", e))?;
        let inner = StreamWriter::try_new(BufWriter::new(file), &schema())
            .map_err(|e| io_err(path, "write", e))?;
        Ok(Self {
            path: path.to_owned(),
            inner,
            pending: Vec::new(),
            rows: 0,
        })
    }

    /// Append one row.
    pub fn push(&mut self, row: Conversation) -> Result<(), StageError> {
        self.pending.push(row);
        self.rows += 1;
        if self.pending.len() >= 8192 {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), StageError> {
        if !self.pending.is_empty() {
            let batch = to_batch(&std::mem::take(&mut self.pending));
            self.inner
                .write(&batch)
                .map_err(|e| io_err(&self.path, "write", e))?;
        }
        Ok(())
    }

    /// Rows written so far.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Finish the file; returns the number of rows in it.
    pub fn finish(mut self) -> Result<u64, StageError> {
        self.flush()?;
        self.inner
            .finish()
            .map_err(|e| io_err(&self.path, "write", e))?;
        Ok(self.rows)
    }
}

/// Write rows to a new file.
pub fn write_rows(path: &Path, rows: &[Conversation]) -> Result<(), StageError> {
    let mut w = Writer::create(path)?;
    for r in rows {
        w.push(r.clone())?;
    }
    w.finish().map(|_| ())
}

/// Read every batch of one file, checking its schema.
pub fn read_batches(path: &Path) -> Result<Vec<RecordBatch>, StageError> {
    let file = File::open(path).map_err(|e| io_err(path, "open", e))?;
    let reader =
        StreamReader::try_new(BufReader::new(file), None).map_err(|e| io_err(path, "read", e))?;
    let version = reader.schema().metadata().get("dflash.schema").cloned();
    if version.as_deref() != Some(SCHEMA_VERSION) {
        return Err(StageError::new(format!(
            "`{}` is not a dflash conversation dataset ({SCHEMA_VERSION}); its schema says {}",
            path.display(),
            version.map_or("nothing".into(), |v| format!("`{v}`"))
        )));
    }
    reader
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| io_err(path, "read", e))
}

/// A zero-copy view of one batch's columns.
pub struct BatchView<'a> {
    /// `id`.
    pub id: &'a StringArray,
    /// `source`.
    pub source: &'a StringArray,
    /// `category`.
    pub category: &'a StringArray,
    /// `messages`.
    pub messages: &'a ListArray,
    /// `role` of every message of the batch.
    pub role: &'a StringArray,
    /// `content` of every message of the batch.
    pub content: &'a StringArray,
    /// `reasoning` of every message of the batch.
    pub reasoning: &'a StringArray,
    /// `tool_calls` of every message of the batch.
    pub tool_calls: &'a StringArray,
    /// `tools`.
    pub tools: &'a StringArray,
    /// `metadata`.
    pub metadata: &'a StringArray,
    /// `finish_reason`.
    pub finish_reason: &'a StringArray,
}

impl<'a> BatchView<'a> {
    /// View a batch of the canonical schema.
    pub fn new(batch: &'a RecordBatch) -> Self {
        let messages = batch.column(3).as_list::<i32>();
        let items: &StructArray = messages.values().as_struct();
        Self {
            id: batch.column(0).as_string(),
            source: batch.column(1).as_string(),
            category: batch.column(2).as_string(),
            messages,
            role: items.column(0).as_string(),
            content: items.column(1).as_string(),
            reasoning: items.column(2).as_string(),
            tool_calls: items.column(3).as_string(),
            tools: batch.column(4).as_string(),
            metadata: batch.column(5).as_string(),
            finish_reason: batch.column(6).as_string(),
        }
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.id.len()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.id.is_empty()
    }

    /// The index range of row `i`'s messages in `role`, `content` and `reasoning`.
    pub fn message_range(&self, i: usize) -> std::ops::Range<usize> {
        let o = self.messages.value_offsets();
        o[i] as usize..o[i + 1] as usize
    }

    /// Row `i`'s category, if it has one.
    pub fn category_of(&self, i: usize) -> Option<&'a str> {
        (!self.category.is_null(i)).then(|| self.category.value(i))
    }

    /// Row `i` as an owned value.
    pub fn row(&self, i: usize) -> Conversation {
        let opt = |a: &StringArray, i: usize| (!a.is_null(i)).then(|| a.value(i).to_owned());
        Conversation {
            id: self.id.value(i).to_owned(),
            source: self.source.value(i).to_owned(),
            category: opt(self.category, i),
            messages: self
                .message_range(i)
                .map(|j| Message {
                    role: self.role.value(j).to_owned(),
                    content: self.content.value(j).to_owned(),
                    reasoning: opt(self.reasoning, j),
                    tool_calls: opt(self.tool_calls, j),
                })
                .collect(),
            tools: opt(self.tools, i),
            metadata: opt(self.metadata, i),
            finish_reason: opt(self.finish_reason, i),
        }
    }
}

/// Every row of one file.
pub fn read_rows(path: &Path) -> Result<Vec<Conversation>, StageError> {
    let mut rows = Vec::new();
    for b in read_batches(path)? {
        let v = BatchView::new(&b);
        rows.extend((0..v.len()).map(|i| v.row(i)));
    }
    Ok(rows)
}

/// The dataset files under `dir`, by split, each split's files in order.
pub fn files(dir: &Path) -> Result<BTreeMap<String, Vec<PathBuf>>, StageError> {
    let mut out: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    let entries = std::fs::read_dir(dir).map_err(|e| io_err(dir, "list", e))?;
    for entry in entries {
        let path = entry.map_err(|e| io_err(dir, "list", e))?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if let Some((split, _)) = name
            .strip_suffix(".arrow")
            .and_then(|stem| stem.rsplit_once('-'))
        {
            out.entry(split.to_owned()).or_default().push(path.clone());
        }
    }
    for list in out.values_mut() {
        list.sort();
    }
    Ok(out)
}

/// The file name of part `index` of `split`.
pub fn file_name(split: &str, index: usize) -> String {
    format!("{split}-{index:05}.arrow")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<Conversation> {
        vec![
            Conversation {
                id: "a".into(),
                source: "s".into(),
                category: Some("code".into()),
                messages: vec![
                    Message {
                        role: "user".into(),
                        content: "héllo 世界".into(),
                        reasoning: None,
                        tool_calls: None,
                    },
                    Message {
                        role: "assistant".into(),
                        content: "hi".into(),
                        reasoning: Some("think".into()),
                        tool_calls: Some("[]".into()),
                    },
                ],
                tools: Some("[{\"type\":\"function\"}]".into()),
                metadata: Some("{\"k\":1}".into()),
                finish_reason: Some("stop".into()),
            },
            Conversation {
                id: "b".into(),
                source: "s".into(),
                ..Conversation::default()
            },
        ]
    }

    #[test]
    fn rows_round_trip_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(file_name("train", 0));
        write_rows(&path, &sample()).unwrap();
        assert_eq!(read_rows(&path).unwrap(), sample());
        assert!(
            write_rows(&path, &sample()).is_err(),
            "an existing file is never replaced"
        );
        let listed = files(dir.path()).unwrap();
        assert_eq!(listed["train"], vec![path]);
    }

    #[test]
    fn foreign_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.arrow");
        let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Utf8, false)]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(StringArray::from(vec!["x"])) as ArrayRef],
        )
        .unwrap();
        let mut w = StreamWriter::try_new(File::create(&path).unwrap(), &schema).unwrap();
        w.write(&batch).unwrap();
        w.finish().unwrap();
        let err = read_batches(&path).unwrap_err();
        assert!(
            err.message.contains("not a dflash conversation dataset"),
            "{}",
            err.message
        );
    }
}
