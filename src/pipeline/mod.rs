//! Pipeline files: YAML text -> a validated [`Pipeline`].
//!
//! Reads the file, parses it with serde_yaml (syntax, anchors with serde_yaml's expansion limits),
//! checks its shape, each stage's kind and typed params (filling in defaults, so spelling out a
//! default never changes a key), and every input reference. All problems are collected and
//! returned together as [`Problems`], each located by [`spans::Spans`]. Cycles are found later by
//! [`crate::graph`], which reports into the same [`Problems`].

mod problem;
pub mod spans;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dflash_stage_api::{Digest, PathSeg, describe_value};
use miette::NamedSource;
use serde_json::Value;

pub use problem::{Problem, Problems, did_you_mean};
use spans::Spans;

use crate::kinds::Registry;

/// A validated pipeline.
#[derive(Debug)]
pub struct Pipeline {
    /// `name:` or the file stem.
    pub name: String,
    /// The file it came from.
    pub path: PathBuf,
    /// blake3 of the file's bytes.
    pub digest: Digest,
    /// `store:`, if given.
    pub store: Option<String>,
    /// Stages in file order.
    pub stages: Vec<StageSpec>,
    /// Kept for reporting later problems (cycles) against the file.
    pub(crate) text: Arc<String>,
    pub(crate) spans: Spans,
}

/// One stage as the pipeline declares it, params resolved.
#[derive(Clone, Debug)]
pub struct StageSpec {
    /// Its id (the key under `stages:`).
    pub id: String,
    /// Its kind.
    pub kind: String,
    /// Its inputs in order.
    pub inputs: Vec<InputRef>,
    /// Params checked against the kind's schema, defaults filled in.
    pub params: Value,
    /// `expect:`: declared data sizes for `dflash estimate` (never part of the key).
    pub expect: Value,
    /// For a stage a `matrix:` made (`ID@param=value,...`), the id that declared it.
    pub matrix_of: Option<String>,
}

/// A reference to an upstream stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputRef {
    /// The name the stage sees the input by (the upstream id, or the role in a map).
    pub name: String,
    /// The upstream stage id.
    pub stage: String,
}

/// Reading or validating a pipeline failed.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum LoadError {
    /// The file could not be read.
    #[error("cannot read pipeline `{path}`: {source}")]
    #[diagnostic(
        code(dflash::pipeline::unreadable),
        help("check the path; pipelines live under `pipelines/`")
    )]
    Unreadable {
        /// The path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not UTF-8.
    #[error("pipeline `{path}` is not UTF-8 text (invalid byte at offset {offset})")]
    #[diagnostic(code(dflash::pipeline::not_utf8), help("save the file as UTF-8"))]
    NotUtf8 {
        /// The path.
        path: String,
        /// Where the first invalid byte is.
        offset: usize,
    },
    /// The file has problems.
    #[error(transparent)]
    #[diagnostic(transparent)]
    Invalid(#[from] Box<Problems>),
}

const TOP_KEYS: &[&str] = &["name", "store", "stages", "description"];
const STAGE_KEYS: &[&str] = &[
    "kind",
    "inputs",
    "params",
    "matrix",
    "expect",
    "description",
];

/// At most this many stages from one `matrix:`.
const MAX_VARIANTS: usize = 256;

/// What a stage may declare under `expect:` for `dflash estimate`, before any data exists.
/// It never enters a key: it describes the data, it does not change what is computed.
fn expect_schema() -> Vec<dflash_stage_api::Param> {
    use dflash_stage_api::{Param, ParamType};
    vec![
        Param::new(
            "rows",
            ParamType::Int,
            "rows this stage is expected to output",
        ),
        Param::new(
            "prompt_tokens",
            ParamType::Float,
            "mean prompt tokens per row",
        ),
        Param::new(
            "output_tokens",
            ParamType::Float,
            "mean generated tokens per row",
        ),
        Param::new(
            "tokens",
            ParamType::Float,
            "mean tokens per row after tokenizing",
        ),
    ]
}

/// Largest pipeline file accepted; far beyond any real pipeline, small enough that a runaway
/// generated file can't exhaust memory.
const MAX_FILE_BYTES: u64 = 64 << 20;

/// Which stages the kinds' own checks cover, and where relative paths resolve.
#[derive(Clone, Copy, Debug)]
pub struct KindChecks<'a> {
    /// The directory relative paths in params resolve against.
    pub cwd: &'a Path,
    /// `run --only`: these stages and what they need; empty: every stage.
    pub only: &'a [String],
}

/// Read and validate a pipeline file. With `kind_checks`, the stage kinds' own checks run too —
/// relations, upstream params, files that must exist — as `plan` and `run` need; commands that
/// only read the store or size the plan (`show`, `diff`, `estimate`) leave them out, so a model
/// not on this machine yet is no obstacle to them.
pub fn load(
    path: &Path,
    registry: &Registry,
    kind_checks: Option<KindChecks<'_>>,
) -> Result<Pipeline, LoadError> {
    let shown = path.display().to_string();
    let unreadable = |source| LoadError::Unreadable {
        path: shown.clone(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(unreadable)?;
    if meta.is_dir() {
        return Err(unreadable(std::io::Error::other("it is a directory")));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(unreadable(std::io::Error::other(format!(
            "it is {} bytes, more than the limit of {MAX_FILE_BYTES}",
            meta.len()
        ))));
    }
    let bytes = std::fs::read(path).map_err(unreadable)?;
    let text = String::from_utf8(bytes).map_err(|e| LoadError::NotUtf8 {
        path: shown.clone(),
        offset: e.utf8_error().valid_up_to(),
    })?;
    parse(&shown, path, text, registry, kind_checks).map_err(|p| LoadError::Invalid(Box::new(p)))
}

/// Validate pipeline text; `name` labels errors; `kind_checks` as for [`load`].
pub fn parse(
    name: &str,
    path: &Path,
    text: String,
    registry: &Registry,
    kind_checks: Option<KindChecks<'_>>,
) -> Result<Pipeline, Problems> {
    let text = Arc::new(text);
    let fail = |problems: Vec<Problem>| Problems {
        source: NamedSource::new(name, text.clone()).with_language("yaml"),
        problems,
    };
    let doc: serde_yaml::Value = match serde_yaml::from_str(&text) {
        Ok(v) => v,
        Err(e) => return Err(fail(vec![syntax_problem(&text, &e)])),
    };
    let mut spans = Spans::index(&text);
    let mut v = Validator {
        text: &text,
        spans: &mut spans,
        problems: Vec::new(),
        unchecked: std::collections::HashSet::new(),
    };
    let doc = v.yaml_to_json(&doc, &[]);
    let pipeline = v.pipeline(&doc, path, registry);
    // The kinds' own checks see resolved params: they run for every stage whose params have
    // the right types and ranges, so all problems are reported at once, none twice.
    if let (Some((_, _, stages)), Some(checks)) = (&pipeline, kind_checks) {
        v.kind_checks(stages, registry, checks);
    }
    if !v.problems.is_empty() {
        let problems = v.problems;
        // A matrix's variants share their text: what is wrong there is said once (the same
        // problem at the same place, told of another variant).
        let variants: Vec<(&str, &str)> = pipeline
            .as_ref()
            .map(|(_, _, stages)| {
                stages
                    .iter()
                    .filter_map(|s| Some((s.id.as_str(), s.matrix_of.as_deref()?)))
                    .collect()
            })
            .unwrap_or_default();
        let keys: Vec<_> = problems
            .iter()
            .map(|p| {
                let told = variants.iter().fold(p.message.clone(), |m, (id, base)| {
                    m.replace(&format!("`{id}`"), &format!("`{base}`"))
                });
                (p.code, p.span.clone(), told)
            })
            .collect();
        let mut times: std::collections::HashMap<_, usize> = std::collections::HashMap::new();
        for k in &keys {
            *times.entry(k).or_default() += 1;
        }
        let mut kept = Vec::with_capacity(problems.len());
        for (mut p, k) in problems.into_iter().zip(&keys) {
            match times.get_mut(k) {
                // Told of every variant alike: the declaring stage's, said once and named so.
                Some(n) if *n > 1 => {
                    p.message.clone_from(&k.2);
                    *n = 0;
                    kept.push(p);
                }
                Some(1) => kept.push(p),
                _ => {}
            }
        }
        let mut problems = kept;
        problems.sort_by_key(|p| p.span.start);
        return Err(fail(problems));
    }
    let (name, store, stages) = pipeline.expect("no problems means a pipeline");
    let digest = Digest::of(text.as_bytes());
    Ok(Pipeline {
        name,
        path: path.to_owned(),
        digest,
        store,
        stages,
        text,
        spans,
    })
}

impl Pipeline {
    /// Wrap problems found after validation (cycles) so they render against this file.
    pub fn problems(&self, problems: Vec<Problem>) -> Problems {
        Problems {
            source: NamedSource::new(self.path.display().to_string(), self.text.clone())
                .with_language("yaml"),
            problems,
        }
    }

    /// A kind's issue with a stage's params, found once upstream data existed
    /// ([`dflash_stage_api::StageKind::check_input`]), as one line that says where in the file
    /// (`path:line:col`), what, and against whose output.
    pub fn issue_line(&self, id: &str, issue: &dflash_stage_api::Issue, from: &str) -> String {
        use miette::SourceCode as _;
        let p = issue_problem(&self.spans, id, issue, Some(from));
        let (line, col) = self
            .text
            .as_str()
            .read_span(&p.span.clone().into(), 0, 0)
            .map_or((0, 0), |s| (s.line(), s.column()));
        format!(
            "{}:{}:{}: {}",
            self.path.display(),
            line + 1,
            col + 1,
            p.message
        )
    }

    /// The byte range of a stage's key, for labels.
    pub fn stage_span(&self, id: &str) -> std::ops::Range<usize> {
        self.spans.key(&["stages", id])
    }

    /// The byte range of one input reference.
    pub fn input_span(&self, id: &str, index: usize, input: &InputRef) -> std::ops::Range<usize> {
        let by_index = self
            .spans
            .value(&["stages", id, "inputs", &index.to_string()]);
        let by_role = self.spans.value(&["stages", id, "inputs", &input.name]);
        if by_role.end > by_role.start && by_role != self.spans.value(&["stages", id, "inputs"]) {
            by_role
        } else {
            by_index
        }
    }
}

fn syntax_problem(text: &str, e: &serde_yaml::Error) -> Problem {
    let offset = e.location().map_or(0, |l| l.index().min(text.len()));
    let msg = e.to_string();
    // serde_yaml appends " at line L column C"; the label already shows where.
    let msg = msg.split(" at line ").next().unwrap_or(&msg).to_owned();
    let (code, help) = if msg.contains("duplicate entry") {
        (
            "dflash::pipeline::duplicate_id",
            "each stage id (and each key of a map) may appear once; rename one of them",
        )
    } else if msg.contains("repetition limit") || msg.contains("recursion limit") {
        (
            "dflash::pipeline::too_large",
            "the document expands (through anchors and aliases) beyond what a pipeline needs",
        )
    } else {
        (
            "dflash::pipeline::syntax",
            "check the indentation and quoting near the marked position",
        )
    };
    let end = (offset + 1).min(text.len()).max(offset);
    Problem::new(code, format!("invalid YAML: {msg}"), offset..end, "here").help(help)
}

struct Validator<'a> {
    /// The file's text (a matrix's values name its stages as written).
    text: &'a str,
    spans: &'a mut Spans,
    problems: Vec<Problem>,
    /// Stages whose params have problems of type or range: their kind's checks would only
    /// repeat them.
    unchecked: std::collections::HashSet<String>,
}

type Parsed = (String, Option<String>, Vec<StageSpec>);

impl Validator<'_> {
    fn at(&self, path: &[&str]) -> std::ops::Range<usize> {
        self.spans.value(path)
    }

    fn push(&mut self, p: Problem) {
        self.problems.push(p);
    }

    /// YAML -> JSON values: map keys must be strings, no tags, no NaN.
    fn yaml_to_json(&mut self, v: &serde_yaml::Value, path: &[String]) -> Value {
        use serde_yaml::Value as Y;
        let p: Vec<&str> = path.iter().map(String::as_str).collect();
        match v {
            Y::Null => Value::Null,
            Y::Bool(b) => Value::Bool(*b),
            Y::Number(n) => {
                if let Some(i) = n.as_i64() {
                    i.into()
                } else if let Some(u) = n.as_u64() {
                    u.into()
                } else if let Some(num) = n.as_f64().and_then(serde_json::Number::from_f64) {
                    Value::Number(num)
                } else {
                    let span = self.at(&p);
                    self.push(Problem::new(
                        "dflash::pipeline::bad_number",
                        format!("`{n}` is not a finite number"),
                        span,
                        "here",
                    ));
                    Value::Null
                }
            }
            Y::String(s) => Value::String(s.clone()),
            Y::Sequence(items) => Value::Array(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, item)| {
                        let mut sub = path.to_vec();
                        sub.push(i.to_string());
                        self.yaml_to_json(item, &sub)
                    })
                    .collect(),
            ),
            Y::Mapping(map) => {
                let mut out = serde_json::Map::new();
                for (k, item) in map {
                    let key = match k {
                        Y::String(s) => s.clone(),
                        Y::Number(n) => n.to_string(),
                        Y::Bool(b) => b.to_string(),
                        other => {
                            let span = self.at(&p);
                            self.push(Problem::new(
                                "dflash::pipeline::bad_key",
                                format!("map keys must be strings, found {other:?}"),
                                span,
                                "in this map",
                            ));
                            continue;
                        }
                    };
                    let mut sub = path.to_vec();
                    sub.push(key.clone());
                    let value = self.yaml_to_json(item, &sub);
                    out.insert(key, value);
                }
                Value::Object(out)
            }
            Y::Tagged(t) => {
                let span = self.at(&p);
                self.push(
                    Problem::new(
                        "dflash::pipeline::tag",
                        format!("YAML tags are not supported (`{}`)", t.tag),
                        span,
                        "tagged value",
                    )
                    .help("remove the tag"),
                );
                Value::Null
            }
        }
    }

    fn unknown_keys(
        &mut self,
        map: &serde_json::Map<String, Value>,
        allowed: &[&str],
        at: &[&str],
        what: &str,
    ) {
        for key in map.keys() {
            if !allowed.contains(&key.as_str()) {
                let mut path = at.to_vec();
                path.push(key);
                let span = self.spans.key(&path);
                let mut p = Problem::new(
                    "dflash::pipeline::unknown_field",
                    format!("unknown field `{key}` in {what}"),
                    span,
                    "unknown field",
                );
                p = match did_you_mean(key, allowed.iter().copied()) {
                    Some(s) => p.help(format!("did you mean `{s}`?")),
                    None => p.help(format!("expected one of {}", list(allowed))),
                };
                self.push(p);
            }
        }
    }

    fn pipeline(&mut self, doc: &Value, path: &Path, registry: &Registry) -> Option<Parsed> {
        let Some(top) = doc.as_object() else {
            let span = self.at(&[]);
            self.push(
                Problem::new(
                    "dflash::pipeline::shape",
                    "a pipeline file must be a map with `stages:`",
                    span,
                    "not a map",
                )
                .help("start from pipelines/quickstart.yaml"),
            );
            return None;
        };
        self.unknown_keys(top, TOP_KEYS, &[], "the pipeline");
        let name = match top.get("name") {
            None => path.file_stem().map_or_else(
                || "pipeline".to_owned(),
                |s| s.to_string_lossy().into_owned(),
            ),
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(other) => {
                let span = self.at(&["name"]);
                self.push(Problem::new(
                    "dflash::pipeline::shape",
                    format!(
                        "`name` must be a non-empty string, found {}",
                        describe_value(other)
                    ),
                    span,
                    "here",
                ));
                String::new()
            }
        };
        let store = match top.get("store") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(other) => {
                let span = self.at(&["store"]);
                self.push(
                    Problem::new(
                        "dflash::pipeline::shape",
                        format!(
                            "`store` must be a URL or path, found {}",
                            describe_value(other)
                        ),
                        span,
                        "here",
                    )
                    .help("e.g. `store: s3://bucket/dflash` or `store: ./cache`"),
                );
                None
            }
        };
        let Some(stages_v) = top.get("stages") else {
            let span = self.at(&[]);
            self.push(
                Problem::new(
                    "dflash::pipeline::shape",
                    "the pipeline has no `stages:`",
                    span.start..span.start,
                    "expected `stages:` in this map",
                )
                .help("add `stages:` with at least one stage"),
            );
            return None;
        };
        let Some(stages_map) = stages_v.as_object() else {
            let span = self.at(&["stages"]);
            self.push(Problem::new(
                "dflash::pipeline::shape",
                format!(
                    "`stages` must be a map of stage ids to stages, found {}",
                    describe_value(stages_v)
                ),
                span,
                "here",
            ));
            return None;
        };
        let mut stages = Vec::new();
        for (id, spec) in stages_map {
            stages.extend(self.stage(id, spec, registry));
        }
        let ids: Vec<&str> = stages_map.keys().map(String::as_str).collect();
        self.check_inputs(&stages, &ids);
        let stages = self.matrix_inputs(stages);
        Some((name, store, stages))
    }

    /// A stage as declared; several with a `matrix:` (one per combination of its values).
    fn stage(&mut self, id: &str, spec: &Value, registry: &Registry) -> Vec<StageSpec> {
        if id.is_empty()
            || !id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
        {
            let span = self.spans.key(&["stages", id]);
            self.push(
                Problem::new(
                    "dflash::pipeline::bad_id",
                    format!("stage id `{id}` may only hold letters, digits, `_`, `-` and `.`"),
                    span,
                    "this id",
                )
                .help("ids name stages on the command line and in `$DFLASH_IN_<ID>`"),
            );
        }
        let Some(map) = spec.as_object() else {
            let span = self.at(&["stages", id]);
            self.push(Problem::new(
                "dflash::pipeline::shape",
                format!(
                    "stage `{id}` must be a map with `kind:`, found {}",
                    describe_value(spec)
                ),
                span,
                "here",
            ));
            return Vec::new();
        };
        self.unknown_keys(map, STAGE_KEYS, &["stages", id], &format!("stage `{id}`"));
        let kind_name = match map.get("kind") {
            Some(Value::String(k)) => k.clone(),
            other => {
                let span = if other.is_some() {
                    self.at(&["stages", id, "kind"])
                } else {
                    self.spans.key(&["stages", id])
                };
                self.push(
                    Problem::new(
                        "dflash::pipeline::missing_kind",
                        format!("stage `{id}` has no `kind`"),
                        span,
                        "needs `kind:`",
                    )
                    .help(format!("kinds: {}", list(&registry.names()))),
                );
                return Vec::new();
            }
        };
        let inputs = self.inputs(id, map.get("inputs"));
        let Some(kind) = registry.get(&kind_name) else {
            let span = self.at(&["stages", id, "kind"]);
            let names = registry.names();
            let help = match did_you_mean(&kind_name, names.iter().copied()) {
                Some(s) => format!("did you mean `{s}`? known kinds: {}", list(&names)),
                None => format!("known kinds: {}", list(&names)),
            };
            self.push(
                Problem::new(
                    "dflash::pipeline::unknown_kind",
                    format!("unknown stage kind `{kind_name}`"),
                    span,
                    "unknown kind",
                )
                .help(help),
            );
            return Vec::new();
        };
        let expect = self.section(
            id,
            &kind_name,
            "expect",
            &expect_schema(),
            map.get("expect"),
        );
        let schema = kind.params();
        let given = map.get("params");
        let variants: Vec<(String, Option<std::borrow::Cow<'_, Value>>)> = match map.get("matrix") {
            None => vec![(id.to_owned(), given.map(std::borrow::Cow::Borrowed))],
            Some(m) => self
                .matrix(id, &kind_name, &schema, m, given)
                .into_iter()
                .map(|(vid, params)| (vid, Some(std::borrow::Cow::Owned(params))))
                .collect(),
        };
        let matrix_of = map.contains_key("matrix").then(|| id.to_owned());
        let mut out = Vec::with_capacity(variants.len());
        for (vid, given) in variants {
            let before = self.problems.len();
            let params = self.section(&vid, &kind_name, "params", &schema, given.as_deref());
            // A missing param leaves the others worth checking; a wrong type or range does not.
            if self.problems[before..]
                .iter()
                .any(|p| p.code != "dflash::pipeline::missing_param")
            {
                self.unchecked.insert(vid.clone());
            }
            out.push(StageSpec {
                id: vid,
                kind: kind_name.clone(),
                inputs: inputs.clone(),
                params,
                expect: expect.clone(),
                matrix_of: matrix_of.clone(),
            });
        }
        out
    }

    /// A stage's `matrix:` (params to lists of values): one `(id, params)` per combination, the
    /// first param varying slowest, each id `ID@param=value,...`, each variant's params the
    /// stage's with the matrix's values set. Nothing where the matrix is malformed (the
    /// problems say why).
    fn matrix(
        &mut self,
        id: &str,
        kind: &str,
        schema: &[dflash_stage_api::Param],
        m: &Value,
        given: Option<&Value>,
    ) -> Vec<(String, Value)> {
        let names: Vec<&str> = schema.iter().map(|p| p.name).collect();
        let malformed = |this: &mut Self, at: &[&str], message: String, help: &str| {
            let span = this.at(at);
            this.push(Problem::new("dflash::pipeline::matrix", message, span, "here").help(help));
        };
        let Some(map) = m.as_object().filter(|m| !m.is_empty()) else {
            malformed(
                self,
                &["stages", id, "matrix"],
                format!(
                    "`matrix` of `{id}` must map params to lists of values, found {}",
                    describe_value(m)
                ),
                "e.g. `matrix: {lr: [6e-4, 2e-3], block_size: [8, 16]}`",
            );
            return Vec::new();
        };
        // Each param swept: its values and how they show in stage ids.
        let mut axes: Vec<(&str, &Vec<Value>, Vec<String>)> = Vec::new();
        for (param, values) in map {
            let at = ["stages", id, "matrix", param.as_str()];
            if !names.contains(&param.as_str()) {
                let p = Problem::new(
                    "dflash::pipeline::unknown_param",
                    format!("`{kind}` has no param `{param}`"),
                    self.spans.key(&at),
                    "unknown param",
                );
                self.push(match did_you_mean(param, names.iter().copied()) {
                    Some(s) => p.help(format!("did you mean `{s}`?")),
                    None => p.help(format!("`{kind}` params: {}", list(&names))),
                });
                continue;
            }
            if given.and_then(|g| g.get(param)).is_some() {
                malformed(
                    self,
                    &at,
                    format!("param `{param}` of `{id}` is in both `params` and `matrix`"),
                    "keep it in one: the matrix's values would replace the param's",
                );
                continue;
            }
            let list = match values {
                Value::Array(list) if !list.is_empty() => list,
                other => {
                    malformed(
                        self,
                        &at,
                        format!(
                            "`matrix.{param}` of `{id}` must be a non-empty list of values, found {}",
                            describe_value(other)
                        ),
                        "e.g. `[6e-4, 2e-3]`",
                    );
                    continue;
                }
            };
            if let Some(again) = (1..list.len()).find(|&i| list[..i].contains(&list[i])) {
                let span = self.at(&["stages", id, "matrix", param, &again.to_string()]);
                self.push(Problem::new(
                    "dflash::pipeline::matrix",
                    format!("`matrix.{param}` of `{id}` lists a value twice"),
                    span,
                    "again",
                ));
                continue;
            }
            let labels = self.labels(&at, list);
            axes.push((param, list, labels));
        }
        if axes.len() != map.len() {
            return Vec::new();
        }
        let count = axes.iter().map(|(_, l, _)| l.len()).product::<usize>();
        if count > MAX_VARIANTS {
            malformed(
                self,
                &["stages", id, "matrix"],
                format!("`matrix` of `{id}` makes {count} stages, more than {MAX_VARIANTS}"),
                "sweep fewer values at a time",
            );
            return Vec::new();
        }
        let mut out = Vec::with_capacity(count);
        for n in 0..count {
            // The n-th combination, the last axis varying fastest.
            let mut rest = n;
            let mut at = vec![0; axes.len()];
            for (a, (_, list, _)) in axes.iter().enumerate().rev() {
                at[a] = rest % list.len();
                rest /= list.len();
            }
            let mut params = match given {
                Some(Value::Object(p)) => p.clone(),
                _ => serde_json::Map::new(),
            };
            let mut parts = Vec::with_capacity(axes.len());
            let mut set = Vec::with_capacity(axes.len());
            for ((param, list, labels), &i) in axes.iter().zip(&at) {
                params.insert((*param).to_owned(), list[i].clone());
                parts.push(format!("{param}={}", labels[i]));
                set.push(((*param).to_owned(), i));
            }
            let vid = format!("{id}@{}", parts.join(","));
            self.spans.add_variant(&vid, id, set);
            out.push((vid, Value::Object(params)));
        }
        out
    }

    /// How a matrix's values (at `at` in the file) show in stage ids: a number as written
    /// (`6e-4`, not `0.0006`), a string as it reads, the index in the list for a value that is
    /// not a short scalar; every value by its index where two would show alike (`1` and `"1"`).
    fn labels(&self, at: &[&str], list: &[Value]) -> Vec<String> {
        let shown: Vec<String> = list
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let mut path = at.to_vec();
                let index = i.to_string();
                path.push(&index);
                let written = self.text.get(self.at(&path)).unwrap_or_default();
                let shown = match v {
                    Value::Number(_) if written.parse::<f64>().is_ok() => written.to_owned(),
                    Value::Number(n) => n.to_string(),
                    Value::String(s) => s.clone(),
                    Value::Bool(b) => b.to_string(),
                    _ => String::new(),
                };
                let short = !shown.is_empty()
                    && shown.len() <= 32
                    && shown
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "._+-".contains(c));
                if short { shown } else { index }
            })
            .collect();
        let distinct = shown.iter().collect::<std::collections::HashSet<_>>().len() == shown.len();
        if distinct {
            shown
        } else {
            (0..list.len()).map(|i| i.to_string()).collect()
        }
    }

    /// Inputs naming a stage that a `matrix:` expanded: a list's entry takes every variant, in
    /// order; a role (one input) cannot take several, and says so.
    fn matrix_inputs(&mut self, mut stages: Vec<StageSpec>) -> Vec<StageSpec> {
        let mut variants: std::collections::HashMap<String, Vec<String>> =
            std::collections::HashMap::new();
        for s in &stages {
            if let Some(base) = &s.matrix_of {
                variants.entry(base.clone()).or_default().push(s.id.clone());
            }
        }
        if variants.is_empty() {
            return stages;
        }
        for s in &mut stages {
            let mut inputs = Vec::with_capacity(s.inputs.len());
            for input in std::mem::take(&mut s.inputs) {
                match variants.get(&input.stage) {
                    None => inputs.push(input),
                    Some(ids) if input.name == input.stage => {
                        inputs.extend(ids.iter().map(|v| InputRef {
                            name: v.clone(),
                            stage: v.clone(),
                        }));
                    }
                    Some(ids) => {
                        let span = self.at(&["stages", &s.id, "inputs", &input.name]);
                        self.push(
                            Problem::new(
                                "dflash::pipeline::matrix",
                                format!(
                                    "input `{}` of `{}` names `{}`, a matrix of {} stages; a named input takes one",
                                    input.name,
                                    s.id,
                                    input.stage,
                                    ids.len()
                                ),
                                span,
                                "one of several",
                            )
                            .help(format!(
                                "name one (`{}`), or list `{}` in `inputs: [...]` to take them all",
                                ids[0], input.stage
                            )),
                        );
                    }
                }
            }
            s.inputs = inputs;
        }
        stages
    }

    fn inputs(&mut self, id: &str, v: Option<&Value>) -> Vec<InputRef> {
        let bad = |this: &mut Self, at: &[&str], found: &Value| {
            let span = this.at(at);
            this.push(Problem::new("dflash::pipeline::shape", format!("`inputs` of `{id}` must be a list of stage ids or a map of names to stage ids, found {}", describe_value(found)), span, "here"));
        };
        match v {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .filter_map(|(i, item)| match item {
                    Value::String(s) => Some(InputRef {
                        name: s.clone(),
                        stage: s.clone(),
                    }),
                    other => {
                        bad(self, &["stages", id, "inputs", &i.to_string()], other);
                        None
                    }
                })
                .collect(),
            Some(Value::Object(map)) => map
                .iter()
                .filter_map(|(role, item)| match item {
                    Value::String(s) => Some(InputRef {
                        name: role.clone(),
                        stage: s.clone(),
                    }),
                    other => {
                        bad(self, &["stages", id, "inputs", role], other);
                        None
                    }
                })
                .collect(),
            Some(other) => {
                bad(self, &["stages", id, "inputs"], other);
                Vec::new()
            }
        }
    }

    /// Check one section of a stage (`params:` or `expect:`) against its schema and fill in
    /// defaults.
    fn section(
        &mut self,
        id: &str,
        kind: &str,
        section: &str,
        schema: &[dflash_stage_api::Param],
        v: Option<&Value>,
    ) -> Value {
        // `params` errors name the kind ("`mix` has no param"); `expect` is the same for all kinds.
        let (owner, item) = if section == "params" {
            (format!("`{kind}`"), "param")
        } else {
            (format!("`{section}`"), "field")
        };
        let empty = serde_json::Map::new();
        let given = match v {
            None | Some(Value::Null) => &empty,
            Some(Value::Object(m)) => m,
            Some(other) => {
                let span = self.at(&["stages", id, section]);
                self.push(Problem::new(
                    "dflash::pipeline::shape",
                    format!("`{section}` must be a map, found {}", describe_value(other)),
                    span,
                    "here",
                ));
                &empty
            }
        };
        let names: Vec<&str> = schema.iter().map(|p| p.name).collect();
        for key in given.keys() {
            if !names.contains(&key.as_str()) {
                let span = self.spans.key(&["stages", id, section, key]);
                let mut p = Problem::new(
                    "dflash::pipeline::unknown_param",
                    format!("{owner} has no {item} `{key}`"),
                    span,
                    format!("unknown {item}"),
                );
                p = match did_you_mean(key, names.iter().copied()) {
                    Some(s) => p.help(format!("did you mean `{s}`?")),
                    None => p.help(format!("{owner} {item}s: {}", list(&names))),
                };
                self.push(p);
            }
        }
        let mut resolved = serde_json::Map::new();
        for param in schema {
            match given.get(param.name) {
                Some(value) if !value.is_null() => match param.ty.check(value) {
                    Ok(v) => {
                        if let Some(bounds) = &param.bounds {
                            self.out_of_bounds(id, section, param, bounds, &v);
                        }
                        resolved.insert(param.name.to_owned(), v);
                    }
                    Err(m) => {
                        let mut path: Vec<String> = vec![
                            "stages".into(),
                            id.into(),
                            section.into(),
                            param.name.into(),
                        ];
                        path.extend(m.path.iter().map(|s| match s {
                            PathSeg::Key(k) => k.clone(),
                            PathSeg::Index(i) => i.to_string(),
                        }));
                        let p: Vec<&str> = path.iter().map(String::as_str).collect();
                        let span = self.at(&p);
                        let shown = path[3..].join(".");
                        self.push(
                            Problem::new(
                                "dflash::pipeline::param_type",
                                format!(
                                    "{item} `{shown}` of `{id}` must be {}, found {}",
                                    m.expected, m.found
                                ),
                                span,
                                format!("expected {}", m.expected),
                            )
                            .help(param.help),
                        );
                    }
                },
                _ if param.required => {
                    let span = if v.is_some() {
                        self.spans.key(&["stages", id, section])
                    } else {
                        self.spans.key(&["stages", id])
                    };
                    self.push(
                        Problem::new(
                            "dflash::pipeline::missing_param",
                            format!("stage `{id}` (`{kind}`) needs param `{}`", param.name),
                            span,
                            format!("`{}` missing", param.name),
                        )
                        .help(format!("`{}`: {}", param.name, param.help)),
                    );
                }
                _ => {
                    resolved.insert(
                        param.name.to_owned(),
                        param.default.clone().unwrap_or(Value::Null),
                    );
                }
            }
        }
        Value::Object(resolved)
    }

    /// A problem when a number in `value` lies outside the param's range.
    fn out_of_bounds(
        &mut self,
        id: &str,
        section: &str,
        param: &dflash_stage_api::Param,
        bounds: &dflash_stage_api::Bounds,
        value: &Value,
    ) {
        let Some((below, found)) = bounds.first_outside(value) else {
            return;
        };
        let mut path = vec![param.name.to_owned()];
        path.extend(below.iter().map(seg_name));
        let shown = path.join(".");
        let mut full = vec!["stages", id, section];
        full.extend(path.iter().map(String::as_str));
        let span = self.at(&full);
        let found = dflash_stage_api::show_number(found);
        self.push(
            Problem::new(
                "dflash::pipeline::param_range",
                format!(
                    "param `{shown}` of `{id}` must be {}, found `{found}`",
                    bounds.describe()
                ),
                span,
                format!("must be {}", bounds.describe()),
            )
            .help(format!("`{}`: {}", param.name, param.help)),
        );
    }

    /// Run every stage kind's own checks ([`dflash_stage_api::StageKind::check`]): relations
    /// between params, against upstream stages, and files that must exist.
    fn kind_checks(&mut self, stages: &[StageSpec], registry: &Registry, checks: KindChecks<'_>) {
        let cwd = checks.cwd;
        let all = dflash_stage_api::Stages::new(
            stages
                .iter()
                .map(|s| dflash_stage_api::PipelineStage {
                    id: &s.id,
                    kind: &s.kind,
                    params: &s.params,
                    inputs: s.inputs.iter().map(|i| i.stage.as_str()).collect(),
                })
                .collect(),
        );
        // With `--only`, the stages that will run: those named and everything upstream of them
        // (a model that only a later stage needs may not be on this machine yet).
        let only = expand_matrix_names(stages, checks.only);
        let selected: std::collections::HashSet<&str> = all
            .with_upstream(only.iter().map(String::as_str))
            .into_iter()
            .map(|s| s.id)
            .collect();
        for spec in stages {
            let Some(kind) = registry.get(&spec.kind) else {
                continue;
            };
            if self.unchecked.contains(&spec.id)
                || (!checks.only.is_empty() && !selected.contains(spec.id.as_str()))
            {
                continue;
            }
            let inputs: Vec<&str> = spec.inputs.iter().map(|i| i.name.as_str()).collect();
            let input_stages: Vec<&str> = spec
                .inputs
                .iter()
                .map(|i| i.stage.as_str())
                .filter(|&i| i != spec.id)
                .collect();
            let env = dflash_stage_api::CheckEnv {
                cwd,
                inputs: &inputs,
                input_stages: &input_stages,
                stages: &all,
            };
            for issue in kind.check(&spec.params, &env) {
                self.push(self.issue_problem(&spec.id, &issue, None));
            }
        }
    }

    fn issue_problem(
        &self,
        id: &str,
        issue: &dflash_stage_api::Issue,
        from: Option<&str>,
    ) -> Problem {
        issue_problem(&*self.spans, id, issue, from)
    }

    /// `ids`: every declared stage id, including stages that failed validation.
    fn check_inputs(&mut self, stages: &[StageSpec], ids: &[&str]) {
        for s in stages {
            let own = s.matrix_of.as_deref().unwrap_or(&s.id);
            for (i, input) in s.inputs.iter().enumerate() {
                if input.stage == own {
                    let span = self.at(&["stages", &s.id, "inputs", &i.to_string()]);
                    self.push(Problem::new(
                        "dflash::graph::cycle",
                        format!("stage `{}` lists itself as an input", s.id),
                        span,
                        "self-reference",
                    ));
                } else if !ids.contains(&input.stage.as_str()) {
                    let by_index = self.at(&["stages", &s.id, "inputs", &i.to_string()]);
                    let by_role = self.at(&["stages", &s.id, "inputs", &input.name]);
                    let span = if input.name == input.stage {
                        by_index
                    } else {
                        by_role
                    };
                    let mut p = Problem::new(
                        "dflash::pipeline::dangling_input",
                        format!(
                            "stage `{}` takes input `{}`, but no stage has that id",
                            s.id, input.stage
                        ),
                        span,
                        "no such stage",
                    );
                    p = match did_you_mean(&input.stage, ids.iter().copied()) {
                        Some(sug) => p.help(format!("did you mean `{sug}`?")),
                        None => p.help(format!("stages: {}", list(ids))),
                    };
                    self.push(p);
                }
            }
        }
    }
}

/// Stage names as users give them (`--only`): a name that declared a `matrix:` stands for
/// every stage it made.
pub fn expand_matrix_names(stages: &[StageSpec], names: &[String]) -> Vec<String> {
    names
        .iter()
        .flat_map(|name| {
            let made: Vec<String> = stages
                .iter()
                .filter(|s| s.matrix_of.as_deref() == Some(name.as_str()))
                .map(|s| s.id.clone())
                .collect();
            if made.is_empty() {
                vec![name.clone()]
            } else {
                made
            }
        })
        .collect()
}

fn seg_name(s: &PathSeg) -> String {
    match s {
        PathSeg::Key(k) => k.clone(),
        PathSeg::Index(i) => i.to_string(),
    }
}

/// A kind's [`dflash_stage_api::Issue`] as a located problem; `from` names the upstream stage
/// whose output made the value invalid, when the check read one.
fn issue_problem(
    spans: &Spans,
    id: &str,
    issue: &dflash_stage_api::Issue,
    from: Option<&str>,
) -> Problem {
    let below: Vec<String> = issue.at.iter().map(seg_name).collect();
    let mut path = vec!["stages", id, "params"];
    path.extend(below.iter().map(String::as_str));
    // The whole params map: its key (or the stage's, when it has none), not every line of it.
    let span = if below.is_empty() {
        spans.key(&path)
    } else {
        spans.value(&path)
    };
    let message = match (below.is_empty(), from) {
        (true, None) => format!("stage `{id}`: {}", issue.message),
        (false, None) => format!("param `{}` of `{id}`: {}", below.join("."), issue.message),
        (true, Some(f)) => format!(
            "stage `{id}`, against the output of `{f}`: {}",
            issue.message
        ),
        (false, Some(f)) => format!(
            "param `{}` of `{id}`, against the output of `{f}`: {}",
            below.join("."),
            issue.message
        ),
    };
    let mut p = Problem::new("dflash::pipeline::param_check", message, span, "here");
    if let Some(h) = &issue.help {
        p = p.help(h.clone());
    }
    p
}

fn list(items: &[&str]) -> String {
    items
        .iter()
        .map(|i| format!("`{i}`"))
        .collect::<Vec<_>>()
        .join(", ")
}
