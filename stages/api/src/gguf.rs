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
    read(path, false).map(|h| h.metadata)
}

/// The metadata and the tensor list of the GGUF file at `path` (never the tensor data).
pub fn read_header(path: &Path) -> Result<Header, StageError> {
    read(path, true)
}

fn read(path: &Path, with_tensors: bool) -> Result<Header, StageError> {
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
