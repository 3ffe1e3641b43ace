//! Typed params: the schema a stage kind declares, and the checking that coerces a pipeline's
//! values to it.
//!
//! The runtime checks each stage's `params:` against its kind's [`Param`] list before anything
//! runs (so errors point at the YAML), fills in defaults, and hands the stage the resolved
//! JSON value, which the stage deserializes into its own struct.

use serde_json::Value;

/// The type of a param value.
#[derive(Clone, Debug, PartialEq)]
pub enum ParamType {
    /// A string.
    Str,
    /// A signed integer.
    Int,
    /// A floating-point number; integers are accepted and stored as floats, so `1` and `1.0`
    /// give the same key.
    Float,
    /// `true` or `false`.
    Bool,
    /// One of a fixed set of strings.
    Enum(&'static [&'static str]),
    /// A list of values of one type.
    List(Box<ParamType>),
    /// A map from string keys to values of one type.
    Map(Box<ParamType>),
    /// Any JSON-like value, unchecked.
    Any,
}

impl ParamType {
    /// How the type reads in an error message.
    pub fn describe(&self) -> String {
        match self {
            Self::Str => "a string".into(),
            Self::Int => "an integer".into(),
            Self::Float => "a number".into(),
            Self::Bool => "`true` or `false`".into(),
            Self::Enum(options) => {
                let quoted: Vec<String> = options.iter().map(|o| format!("`{o}`")).collect();
                format!("one of {}", quoted.join(", "))
            }
            Self::List(item) => format!("a list of {}", plural(&item.describe())),
            Self::Map(item) => format!("a map of names to {}", plural(&item.describe())),
            Self::Any => "any value".into(),
        }
    }

    /// Check `value` against this type, returning the canonical value (floats for `Float`).
    /// On a mismatch, returns the path below this value where it failed and what was expected.
    pub fn check(&self, value: &Value) -> Result<Value, Mismatch> {
        let mismatch = || Mismatch {
            path: Vec::new(),
            expected: self.describe(),
            found: describe_value(value),
        };
        match (self, value) {
            (Self::Any, v) => Ok(v.clone()),
            (Self::Str, Value::String(_)) | (Self::Bool, Value::Bool(_)) => Ok(value.clone()),
            (Self::Int, Value::Number(n)) if n.is_i64() || n.is_u64() => Ok(value.clone()),
            (Self::Float, Value::Number(n)) => {
                let f = n.as_f64().ok_or_else(mismatch)?;
                serde_json::Number::from_f64(f)
                    .map(Value::Number)
                    .ok_or_else(mismatch)
            }
            (Self::Enum(options), Value::String(s)) if options.contains(&s.as_str()) => {
                Ok(value.clone())
            }
            (Self::List(item), Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| item.check(v).map_err(|m| m.under(PathSeg::Index(i))))
                .collect::<Result<Vec<_>, _>>()
                .map(Value::Array),
            (Self::Map(item), Value::Object(map)) => map
                .iter()
                .map(|(k, v)| {
                    Ok((
                        k.clone(),
                        item.check(v)
                            .map_err(|m| m.under(PathSeg::Key(k.clone())))?,
                    ))
                })
                .collect::<Result<serde_json::Map<_, _>, Mismatch>>()
                .map(Value::Object),
            _ => Err(mismatch()),
        }
    }
}

fn plural(desc: &str) -> String {
    let bare = desc.trim_start_matches("a ").trim_start_matches("an ");
    if bare.starts_with('`')
        || bare.starts_with("one of")
        || bare.starts_with("map")
        || bare.starts_with("list")
    {
        format!("values that are {desc}")
    } else {
        format!("{bare}s")
    }
}

/// How a value reads in an error message: its type and, for scalars, the value itself.
pub fn describe_value(value: &Value) -> String {
    match value {
        Value::Null => "nothing (null)".into(),
        Value::Bool(b) => format!("`{b}`"),
        Value::Number(n) => format!("the number `{n}`"),
        Value::String(s) => format!("the string `{s}`"),
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "a map".into(),
    }
}

/// One step of a path into a value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathSeg {
    /// A map key.
    Key(String),
    /// A list index.
    Index(usize),
}

/// A value that does not have the declared type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// Where below the checked value the mismatch is (empty: the value itself).
    pub path: Vec<PathSeg>,
    /// What was expected, e.g. "an integer".
    pub expected: String,
    /// What was found, e.g. "the string `abc`".
    pub found: String,
}

impl Mismatch {
    fn under(mut self, seg: PathSeg) -> Self {
        self.path.insert(0, seg);
        self
    }
}

/// One param of a stage kind.
#[derive(Clone, Debug)]
pub struct Param {
    /// Its name under `params:`.
    pub name: &'static str,
    /// Its type.
    pub ty: ParamType,
    /// The value used when the pipeline leaves it out; `None` with `required == false` means
    /// "absent" (null).
    pub default: Option<Value>,
    /// Whether the pipeline must give it.
    pub required: bool,
    /// One line of documentation.
    pub help: &'static str,
    /// Whether it enters the stage's key: false for params that say how or where the work is
    /// done, not what it produces (servers, limits, retries, shard sizes), so changing one
    /// after a failure reuses everything already saved.
    pub keyed: bool,
}

impl Param {
    /// An optional param whose absence is `null`.
    pub fn new(name: &'static str, ty: ParamType, help: &'static str) -> Self {
        Self {
            name,
            ty,
            default: None,
            required: false,
            help,
            keyed: true,
        }
    }

    /// Mark it operational: how the work is done, not what it produces. It is left out of the
    /// stage's key (see [`Param::keyed`]).
    #[must_use]
    pub fn operational(mut self) -> Self {
        self.keyed = false;
        self
    }

    /// Make it required.
    #[must_use]
    pub fn required(mut self) -> Self {
        self.required = true;
        self
    }

    /// Give it a default.
    #[must_use]
    pub fn default(mut self, value: impl Into<Value>) -> Self {
        self.default = Some(value.into());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn float_accepts_integers_canonically() {
        assert_eq!(
            ParamType::Float.check(&json!(1)).unwrap(),
            ParamType::Float.check(&json!(1.0)).unwrap()
        );
    }

    #[test]
    fn nested_mismatch_has_path() {
        let t = ParamType::Map(Box::new(ParamType::Int));
        let m = t.check(&json!({"a": 1, "b": "x"})).unwrap_err();
        assert_eq!(m.path, vec![PathSeg::Key("b".into())]);
        assert_eq!(m.expected, "an integer");
        assert_eq!(m.found, "the string `x`");
    }

    #[test]
    fn enum_lists_options() {
        let t = ParamType::Enum(&["keep", "drop"]);
        assert!(t.check(&json!("keep")).is_ok());
        assert_eq!(
            t.check(&json!("x")).unwrap_err().expected,
            "one of `keep`, `drop`"
        );
    }

    #[test]
    fn list_description_reads_well() {
        assert_eq!(
            ParamType::List(Box::new(ParamType::Str)).describe(),
            "a list of strings"
        );
    }
}
