//! Reading the metadata of a GGUF file (llama.cpp's model format), never its tensors.
//!
//! Shared by the stages that take a `.gguf` model: `tokenize` rebuilds the tokenizer from it,
//! the model code and `dflash estimate` read the architecture's shape from it.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use crate::StageError;

/// A metadata value. Integers of every width widen to `i64`, floats to `f64`; arrays of other
/// types (and of bools) are kept only as [`Meta::Other`].
#[derive(Clone, Debug, PartialEq)]
pub enum Meta {
    /// An integer or bool (bools as 0/1).
    Int(i64),
    /// A float.
    Float(f64),
    /// A string.
    Str(String),
    /// An array of strings.
    Strs(Vec<String>),
    /// An array of integers.
    Ints(Vec<i64>),
    /// Anything else (arrays of floats, nested arrays).
    Other,
    /// An array read past without its items (a header read for the model's shape): its length.
    Skipped(u64),
}

const MAGIC: &[u8; 4] = b"GGUF";
/// Metadata arrays longer than this are refused (a corrupt length would allocate forever).
const MAX_ARRAY: u64 = 1 << 26;
const MAX_STRING: u64 = 1 << 28;

struct Reader {
    inner: BufReader<File>,
    /// Read past arrays instead of into memory.
    skip_arrays: bool,
}

/// Bytes of one item of a fixed-size GGUF value type.
fn item_size(ty: u32) -> Option<u64> {
    match ty {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

impl Reader {
    /// Read past `n` bytes (within the buffer when they are there; a truncated file fails at
    /// the next read).
    fn skip(&mut self, n: u64) -> std::io::Result<()> {
        let n = i64::try_from(n).map_err(|_| invalid("an array past any file size"))?;
        self.inner.seek_relative(n)
    }

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

    /// One value of GGUF type `ty`.
    fn scalar(&mut self, ty: u32) -> std::io::Result<Meta> {
        Ok(match ty {
            0 => Meta::Int(i64::from(self.bytes::<1>()?[0])),
            1 => Meta::Int(i64::from(i8::from_le_bytes(self.bytes::<1>()?))),
            2 => Meta::Int(i64::from(u16::from_le_bytes(self.bytes::<2>()?))),
            3 => Meta::Int(i64::from(i16::from_le_bytes(self.bytes::<2>()?))),
            4 => Meta::Int(i64::from(self.u32()?)),
            5 => Meta::Int(i64::from(i32::from_le_bytes(self.bytes::<4>()?))),
            6 => Meta::Float(f64::from(f32::from_le_bytes(self.bytes::<4>()?))),
            7 => Meta::Int(i64::from(self.bytes::<1>()?[0] != 0)),
            8 => Meta::Str(self.string()?),
            10 => Meta::Int(i64::try_from(self.u64()?).unwrap_or(i64::MAX)),
            11 => Meta::Int(i64::from_le_bytes(self.bytes::<8>()?)),
            12 => Meta::Float(f64::from_le_bytes(self.bytes::<8>()?)),
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
        if self.skip_arrays {
            match item {
                8 => {
                    for _ in 0..len {
                        let n = self.u64()?;
                        if n > MAX_STRING {
                            return Err(invalid("a string longer than 256 MiB"));
                        }
                        self.skip(n)?;
                    }
                }
                9 => return Err(invalid("nested arrays")),
                t => self.skip(
                    len * item_size(t)
                        .ok_or_else(|| invalid(&format!("an unknown value type {t}")))?,
                )?,
            }
            return Ok(Meta::Skipped(len));
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
                    if let Meta::Int(i) = self.scalar(item)?
                        && item != 7
                    {
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

/// What a GGUF file's header says: its metadata and the names and shapes of its tensors.
#[derive(Clone, Debug, Default)]
pub struct Header {
    /// Key-value metadata (`general.architecture`, `llama.block_count`, ...).
    pub metadata: BTreeMap<String, Meta>,
    /// Each tensor's name and dimensions (innermost first, as GGUF stores them).
    pub tensors: Vec<(String, Vec<u64>)>,
}

impl Header {
    /// Total number of weights over all tensors.
    pub fn parameters(&self) -> u64 {
        self.tensors
            .iter()
            .map(|(_, dims)| dims.iter().product::<u64>())
            .sum()
    }
}

/// Tensors with more dimensions than this are refused (llama.cpp stores at most 4).
const MAX_DIMS: u32 = 8;

/// The metadata of the GGUF file at `path` (the tensors are never read).
pub fn read_metadata(path: &Path) -> Result<BTreeMap<String, Meta>, StageError> {
    read(path, false, false).map(|h| h.metadata)
}

/// The metadata and the tensor list of the GGUF file at `path` (never the tensor data).
pub fn read_header(path: &Path) -> Result<Header, StageError> {
    read(path, true, false)
}

/// [`read_header`] without the arrays' items (the vocabulary, the merges): each is
/// [`Meta::Skipped`] with its length. What a model's shape needs, in a fraction of the time
/// (`dflash plan` reads it for every stage that names a model).
pub fn read_shape_header(path: &Path) -> Result<Header, StageError> {
    read(path, true, true)
}

fn read(path: &Path, with_tensors: bool, skip_arrays: bool) -> Result<Header, StageError> {
    let err = |e: std::io::Error| {
        StageError::new(format!(
            "cannot read GGUF metadata of `{}`: {e}",
            path.display()
        ))
    };
    let file = File::open(path).map_err(err)?;
    let mut r = Reader {
        inner: BufReader::with_capacity(1 << 20, file),
        skip_arrays,
    };
    let magic = r.bytes::<4>().map_err(err)?;
    if &magic != MAGIC {
        return Err(StageError::new(format!(
            "`{}` is neither a model folder nor a GGUF file",
            path.display()
        ))
        .with_help("give a Hugging Face model folder, or a `.gguf` file"));
    }
    let version = r.u32().map_err(err)?;
    if !(2..=3).contains(&version) {
        return Err(StageError::new(format!(
            "`{}` is GGUF version {version}; dflash reads versions 2 and 3",
            path.display()
        )));
    }
    let tensor_count = r.u64().map_err(err)?;
    let count = r.u64().map_err(err)?;
    let mut header = Header::default();
    for _ in 0..count {
        let key = r.string().map_err(err)?;
        let ty = r.u32().map_err(err)?;
        let value = r.value(ty).map_err(err)?;
        header.metadata.insert(key, value);
    }
    if with_tensors {
        if tensor_count > MAX_ARRAY {
            return Err(err(invalid("more than 64M tensors")));
        }
        for _ in 0..tensor_count {
            let name = r.string().map_err(err)?;
            let n_dims = r.u32().map_err(err)?;
            if n_dims > MAX_DIMS {
                return Err(err(invalid("a tensor with more than 8 dimensions")));
            }
            let dims = (0..n_dims)
                .map(|_| r.u64())
                .collect::<Result<Vec<_>, _>>()
                .map_err(err)?;
            let _type = r.u32().map_err(err)?;
            let _offset = r.u64().map_err(err)?;
            header.tensors.push((name, dims));
        }
    }
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF v3 header by hand: a string array, an int array, a scalar, one tensor.
    fn tiny() -> Vec<u8> {
        let mut b = Vec::new();
        let s = |b: &mut Vec<u8>, t: &str| {
            b.extend((t.len() as u64).to_le_bytes());
            b.extend(t.as_bytes());
        };
        b.extend(b"GGUF");
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.extend(3u64.to_le_bytes());
        s(&mut b, "tokenizer.ggml.tokens");
        b.extend(9u32.to_le_bytes());
        b.extend(8u32.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        s(&mut b, "a");
        s(&mut b, "bc");
        s(&mut b, "tokenizer.ggml.token_type");
        b.extend(9u32.to_le_bytes());
        b.extend(4u32.to_le_bytes());
        b.extend(3u64.to_le_bytes());
        for v in [1u32, 2, 3] {
            b.extend(v.to_le_bytes());
        }
        s(&mut b, "llama.block_count");
        b.extend(4u32.to_le_bytes());
        b.extend(7u32.to_le_bytes());
        s(&mut b, "token_embd.weight");
        b.extend(2u32.to_le_bytes());
        b.extend(4u64.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b
    }

    #[test]
    fn a_shape_read_skips_arrays_and_sees_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, tiny()).unwrap();
        let full = read_header(&path).unwrap();
        let lean = read_shape_header(&path).unwrap();
        assert_eq!(
            full.metadata["tokenizer.ggml.tokens"],
            Meta::Strs(vec!["a".into(), "bc".into()])
        );
        assert_eq!(
            full.metadata["tokenizer.ggml.token_type"],
            Meta::Ints(vec![1, 2, 3])
        );
        assert_eq!(lean.metadata["tokenizer.ggml.tokens"], Meta::Skipped(2));
        assert_eq!(lean.metadata["tokenizer.ggml.token_type"], Meta::Skipped(3));
        assert_eq!(lean.metadata["llama.block_count"], Meta::Int(7));
        assert_eq!(lean.tensors, full.tensors);
        assert_eq!(
            lean.tensors,
            vec![("token_embd.weight".to_owned(), vec![4, 2])]
        );
        // Cut inside the skipped array: an error, not a panic or a wrong header.
        let mut cut = tiny();
        cut.truncate(75);
        std::fs::write(&path, cut).unwrap();
        assert!(read_shape_header(&path).is_err());
    }
}
