//! Reading source files as a stream of JSON records: Parquet (what the Hub serves for most
//! datasets), JSON Lines and JSON, each optionally gzip-compressed.
//!
//! A JSON array that ends mid-record (a truncated upload, as with the public ShareGPT dump) yields
//! every complete record and reports where it broke off, instead of failing the whole file.

use std::io::{BufRead, BufReader, Read};
use std::ops::ControlFlow;
use std::path::Path;

use dflash_stage_api::StageError;
use serde_json::Value;

/// The file formats `download` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Apache Parquet.
    Parquet,
    /// One JSON value per line.
    JsonLines,
    /// One JSON document: an array of records, or an object holding one.
    Json,
}

impl Format {
    /// The format a file name implies (`.gz` is looked through).
    pub fn of(name: &str) -> Option<Self> {
        let name = name.to_ascii_lowercase();
        let name = name.strip_suffix(".gz").unwrap_or(&name);
        if name.ends_with(".parquet") {
            Some(Self::Parquet)
        } else if name.ends_with(".jsonl") || name.ends_with(".ndjson") {
            Some(Self::JsonLines)
        } else if name.ends_with(".json") {
            Some(Self::Json)
        } else {
            None
        }
    }
}

/// Where a record sits in its file, for messages.
#[derive(Debug, Clone, Copy)]
pub enum Location {
    /// Line number (1-based) in a JSON Lines file.
    Line(u64),
    /// Index (0-based) of a row or array element.
    Row(u64),
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Line(n) => write!(f, "line {n}"),
            Self::Row(n) => write!(f, "row {n}"),
        }
    }
}

/// A record or a reason it could not be read.
pub type Record = Result<Value, String>;

/// What reading a file found besides records.
#[derive(Debug, Default)]
pub struct ReadNotes {
    /// The file ended mid-record: the byte offset where the cut-off record starts.
    pub truncated_at: Option<u64>,
}

fn open(path: &Path) -> Result<Box<dyn Read>, StageError> {
    let f = std::fs::File::open(path)
        .map_err(|e| StageError::new(format!("cannot open `{}`: {e}", path.display())))?;
    let gz = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gz"));
    Ok(if gz {
        Box::new(flate2::read::MultiGzDecoder::new(BufReader::new(f)))
    } else {
        Box::new(BufReader::new(f))
    })
}

/// Call `each` for every record of `path`, in order, until it breaks.
pub fn for_each(
    path: &Path,
    format: Format,
    each: &mut dyn FnMut(Location, Record) -> ControlFlow<()>,
) -> Result<ReadNotes, StageError> {
    let shown = path.display();
    match format {
        Format::JsonLines => {
            let reader = BufReader::new(open(path)?);
            for (i, line) in reader.lines().enumerate() {
                let line =
                    line.map_err(|e| StageError::new(format!("cannot read `{shown}`: {e}")))?;
                if line.trim().is_empty() {
                    continue;
                }
                let rec = serde_json::from_str(&line).map_err(|e| format!("not JSON: {e}"));
                if each(Location::Line(i as u64 + 1), rec).is_break() {
                    break;
                }
            }
            Ok(ReadNotes::default())
        }
        Format::Json => {
            let mut text = Vec::new();
            open(path)?
                .read_to_end(&mut text)
                .map_err(|e| StageError::new(format!("cannot read `{shown}`: {e}")))?;
            json_document(&text, each).map_err(|e| StageError::new(format!("`{shown}`: {e}")))
        }
        Format::Parquet => {
            use parquet::file::reader::{FileReader, SerializedFileReader};
            let f = std::fs::File::open(path)
                .map_err(|e| StageError::new(format!("cannot open `{shown}`: {e}")))?;
            let reader = SerializedFileReader::new(f).map_err(|e| {
                StageError::new(format!("`{shown}` is not a readable Parquet file: {e}"))
            })?;
            let rows = reader
                .get_row_iter(None)
                .map_err(|e| StageError::new(format!("cannot read `{shown}`: {e}")))?;
            for (i, row) in rows.enumerate() {
                let rec = row
                    .map(|r| r.to_json_value())
                    .map_err(|e| format!("unreadable Parquet row: {e}"));
                if each(Location::Row(i as u64), rec).is_break() {
                    break;
                }
            }
            Ok(ReadNotes::default())
        }
    }
}

/// Records of a JSON document: the elements of a top-level array, or of the one array of
/// objects inside a top-level object (`{"data": [...]}`).
fn json_document(
    text: &[u8],
    each: &mut dyn FnMut(Location, Record) -> ControlFlow<()>,
) -> Result<ReadNotes, String> {
    let start = text
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .ok_or("the file is empty")?;
    if text[start] == b'{' {
        let doc: Value =
            serde_json::from_slice(text).map_err(|e| format!("not valid JSON: {e}"))?;
        let arrays: Vec<&Vec<Value>> = doc
            .as_object()
            .into_iter()
            .flat_map(|m| m.values())
            .filter_map(Value::as_array)
            .filter(|a| a.first().is_some_and(Value::is_object))
            .collect();
        let [records] = arrays.as_slice() else {
            return Err(format!(
                "a JSON object with {} arrays of records; expected exactly one",
                arrays.len()
            ));
        };
        for (i, r) in records.iter().enumerate() {
            if each(Location::Row(i as u64), Ok(r.clone())).is_break() {
                break;
            }
        }
        return Ok(ReadNotes::default());
    }
    if text[start] != b'[' {
        return Err("expected a JSON array or object".into());
    }
    // Element by element, so a truncated tail costs only the last record.
    let mut pos = start + 1;
    let mut index = 0u64;
    loop {
        while pos < text.len() && (text[pos].is_ascii_whitespace() || text[pos] == b',') {
            pos += 1;
        }
        if pos >= text.len() {
            return Ok(ReadNotes {
                truncated_at: Some(pos as u64),
            });
        }
        if text[pos] == b']' {
            return Ok(ReadNotes::default());
        }
        let mut stream = serde_json::Deserializer::from_slice(&text[pos..]).into_iter::<Value>();
        match stream.next() {
            Some(Ok(v)) => {
                pos += stream.byte_offset();
                if each(Location::Row(index), Ok(v)).is_break() {
                    return Ok(ReadNotes::default());
                }
                index += 1;
            }
            Some(Err(e)) if e.is_eof() => {
                return Ok(ReadNotes {
                    truncated_at: Some(pos as u64),
                });
            }
            Some(Err(e)) => return Err(format!("element {index} is not valid JSON: {e}")),
            None => {
                return Ok(ReadNotes {
                    truncated_at: Some(pos as u64),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(text: &str) -> (Vec<Value>, ReadNotes) {
        let mut out = Vec::new();
        let notes = json_document(text.as_bytes(), &mut |_, r| {
            out.push(r.unwrap());
            ControlFlow::Continue(())
        })
        .unwrap();
        (out, notes)
    }

    #[test]
    fn truncated_array_keeps_complete_records() {
        let (rows, notes) = collect(r#"[{"a": 1}, {"a": 2}, {"a": 3, "b": "unfinis"#);
        assert_eq!(rows.len(), 2);
        assert_eq!(
            notes.truncated_at,
            Some(21),
            "the offset where the cut-off record starts"
        );
        let (rows, notes) = collect(r#" [ {"a": 1} , {"a": 2} ] "#);
        assert_eq!(rows.len(), 2);
        assert!(notes.truncated_at.is_none());
    }

    #[test]
    fn object_with_one_array_of_records() {
        let (rows, _) = collect(r#"{"version": 1, "data": [{"a": 1}, {"a": 2}]}"#);
        assert_eq!(rows.len(), 2);
    }

    #[test]
    fn formats_from_names() {
        assert_eq!(
            Format::of("data/train-00000-of-00002.parquet"),
            Some(Format::Parquet)
        );
        assert_eq!(Format::of("HumanEval.jsonl.gz"), Some(Format::JsonLines));
        assert_eq!(Format::of("x.JSON"), Some(Format::Json));
        assert_eq!(Format::of("README.md"), None);
    }
}
