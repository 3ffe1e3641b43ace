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
    /// The range every number in it must lie in (the value itself, or each item of a list or
    /// map of numbers), checked with the types before anything runs.
    pub bounds: Option<Bounds>,
    /// A path whose content, not its name, decides the output (a model file or folder): when
    /// the kind pins it (pins named `<param>` or `<param>:<file>`), the path itself stays out of
    /// the key, so a renamed or moved copy with the same bytes keeps everything cached.
    pub content: bool,
}

/// A number as a message shows it: `1`, not `1.0`; `0.5`.
pub fn show_number(x: f64) -> String {
    let s = serde_json::Number::from_f64(x).map_or_else(|| x.to_string(), |n| n.to_string());
    s.strip_suffix(".0")
        .map_or_else(|| s.clone(), str::to_owned)
}

/// An allowed range of numbers: each end inclusive or exclusive, or open.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bounds {
    /// The lower end and whether it is allowed itself.
    pub low: Option<(f64, bool)>,
    /// The upper end and whether it is allowed itself.
    pub high: Option<(f64, bool)>,
}

impl Bounds {
    /// Whether `x` lies in the range.
    pub fn contains(&self, x: f64) -> bool {
        let above = self
            .low
            .is_none_or(|(lo, incl)| if incl { x >= lo } else { x > lo });
        let below = self
            .high
            .is_none_or(|(hi, incl)| if incl { x <= hi } else { x < hi });
        above && below
    }

    /// How the range reads in an error message, e.g. "at least 1", "between 0 and 1".
    pub fn describe(&self) -> String {
        let n = show_number;
        match (self.low, self.high) {
            (Some((lo, true)), Some((hi, true))) => format!("between {} and {}", n(lo), n(hi)),
            (Some((lo, li)), Some((hi, hi_incl))) => format!(
                "{} {} and {} {}",
                if li { "at least" } else { "above" },
                n(lo),
                if hi_incl { "at most" } else { "below" },
                n(hi)
            ),
            (Some((lo, true)), None) => format!("at least {}", n(lo)),
            (Some((lo, false)), None) => format!("above {}", n(lo)),
            (None, Some((hi, true))) => format!("at most {}", n(hi)),
            (None, Some((hi, false))) => format!("below {}", n(hi)),
            (None, None) => "any number".into(),
        }
    }

    /// The first number in `value` (itself, or an item of a list or map) outside the range:
    /// where it is below `value` and the number.
    pub fn first_outside(&self, value: &Value) -> Option<(Vec<PathSeg>, f64)> {
        match value {
            Value::Number(n) => n
                .as_f64()
                .filter(|&x| !self.contains(x))
                .map(|x| (Vec::new(), x)),
            Value::Array(items) => items.iter().enumerate().find_map(|(i, v)| {
                self.first_outside(v).map(|(mut p, x)| {
                    p.insert(0, PathSeg::Index(i));
                    (p, x)
                })
            }),
            Value::Object(map) => map.iter().find_map(|(k, v)| {
                self.first_outside(v).map(|(mut p, x)| {
                    p.insert(0, PathSeg::Key(k.clone()));
                    (p, x)
                })
            }),
            _ => None,
        }
    }
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
            bounds: None,
            content: false,
        }
    }

    /// Every number in it must be at least `low`.
    #[must_use]
    pub fn at_least(mut self, low: f64) -> Self {
        self.bounds = Some(Bounds {
            low: Some((low, true)),
            high: None,
        });
        self
    }

    /// Every number in it must be above `low` (exclusive).
    #[must_use]
    pub fn above(mut self, low: f64) -> Self {
        self.bounds = Some(Bounds {
            low: Some((low, false)),
            high: None,
        });
        self
    }

    /// Every number in it must lie between `low` and `high`, both included.
    #[must_use]
    pub fn between(mut self, low: f64, high: f64) -> Self {
        self.bounds = Some(Bounds {
            low: Some((low, true)),
            high: Some((high, true)),
        });
        self
    }

    /// Every number in it must lie in `bounds`.
    #[must_use]
    pub fn within(mut self, bounds: Bounds) -> Self {
        self.bounds = Some(bounds);
        self
    }

    /// Mark it a content path (see [`Param::content`]).
    #[must_use]
    pub fn content(mut self) -> Self {
        self.content = true;
        self
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
    fn bounds_find_the_first_number_outside() {
        let b = Param::new("w", ParamType::Float, "")
            .at_least(0.0)
            .bounds
            .unwrap();
        assert_eq!(b.describe(), "at least 0");
        assert_eq!(
            b.first_outside(&json!({"a": 1.0, "b": -2})),
            Some((vec![PathSeg::Key("b".into())], -2.0))
        );
        assert_eq!(b.first_outside(&json!([0, 3])), None);
        let f = Bounds {
            low: Some((0.0, true)),
            high: Some((1.0, false)),
        };
        assert_eq!(f.describe(), "at least 0 and below 1");
        assert!(!f.contains(1.0));
        assert!(
            Param::new("lr", ParamType::Float, "")
                .above(0.0)
                .bounds
                .unwrap()
                .first_outside(&json!(0.0))
                .is_some()
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
