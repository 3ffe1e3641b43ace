//! Bad input never panics: the shipped pipelines, mutated at random (bytes cut, inserted or
//! swapped, lines duplicated or dropped, values replaced by odd ones, multibyte text among
//! them), are parsed and validated as `dflash plan` does, and every refusal is rendered as the
//! CLI renders it (its spans must fall on the text's character boundaries). A panic anywhere
//! fails the case; proptest shrinks it to the smallest such file.

use std::path::Path;

use proptest::prelude::*;

/// The pipelines users start from (the `zz-*` files are local experiments, not shipped).
fn shipped() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines");
    let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let path = e.unwrap().path();
            let name = path.file_name()?.to_str()?.to_owned();
            (name.ends_with(".yaml") && !name.starts_with("zz-"))
                .then(|| (name, std::fs::read_to_string(&path).unwrap()))
        })
        .collect();
    files.sort();
    assert!(
        files.len() >= 3,
        "the shipped pipelines are under pipelines/"
    );
    files
}

/// Odd values a user might type where a value goes.
const ODD: &[&str] = &[
    "",
    "~",
    "null",
    "[]",
    "{}",
    "-1",
    "0",
    "1e999",
    "NaN",
    "\"\"",
    "é",
    "日本語",
    "🦀",
    "[[[",
    "{a: [",
    "&a",
    "*a",
    "!!binary x",
    "'",
    "\"\\u",
    ": :",
    "- -",
    "\t",
    "18446744073709551616",
    "0x10",
    "${ENV}",
    "../../etc/passwd",
    "s3://",
    "a: b: c",
];

#[derive(Debug, Clone)]
enum Mutation {
    /// Cut `len` bytes at a fraction of the text.
    Cut(f64, usize),
    /// Insert text at a fraction of the text.
    Insert(f64, String),
    /// Replace what follows the `n`-th `: ` on a line with an odd value.
    Value(usize, &'static str),
    /// Duplicate line `n` (modulo the line count).
    DuplicateLine(usize),
    /// Drop line `n`.
    DropLine(usize),
    /// Swap lines `a` and `b`.
    SwapLines(usize, usize),
    /// Indent or dedent line `n` by two spaces.
    Shift(usize, bool),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (0.0..1.0f64, 1..40usize).prop_map(|(at, len)| Mutation::Cut(at, len)),
        (
            0.0..1.0f64,
            prop_oneof![
                Just("é".to_owned()),
                Just("\n".to_owned()),
                "[ -~]{1,8}",
                "\\PC{1,4}"
            ]
        )
            .prop_map(|(at, s)| Mutation::Insert(at, s)),
        (any::<usize>(), proptest::sample::select(ODD)).prop_map(|(n, v)| Mutation::Value(n, v)),
        any::<usize>().prop_map(Mutation::DuplicateLine),
        any::<usize>().prop_map(Mutation::DropLine),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Mutation::SwapLines(a, b)),
        (any::<usize>(), any::<bool>()).prop_map(|(n, i)| Mutation::Shift(n, i)),
    ]
}

/// The byte offset nearest `at` (a fraction) that is a character boundary of `text`.
fn boundary(text: &str, at: f64) -> usize {
    let mut i = ((text.len() as f64) * at) as usize;
    while !text.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn apply(text: &str, m: &Mutation) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let n = lines.len().max(1);
    match m {
        Mutation::Cut(at, len) => {
            let from = boundary(text, *at);
            let mut to = (from + len).min(text.len());
            while !text.is_char_boundary(to) {
                to += 1;
            }
            return format!("{}{}", &text[..from], &text[to..]);
        }
        Mutation::Insert(at, s) => {
            let i = boundary(text, *at);
            return format!("{}{s}{}", &text[..i], &text[i..]);
        }
        Mutation::Value(k, v) => {
            let with: Vec<usize> = (0..lines.len())
                .filter(|&i| lines[i].contains(": "))
                .collect();
            if let Some(&i) = with.get(k % with.len().max(1)) {
                let at = lines[i].find(": ").unwrap();
                lines[i] = format!("{}: {v}", &lines[i][..at]);
            }
        }
        Mutation::DuplicateLine(k) if !lines.is_empty() => {
            let line = lines[k % n].clone();
            lines.insert(k % n, line);
        }
        Mutation::DropLine(k) if !lines.is_empty() => {
            lines.remove(k % n);
        }
        Mutation::SwapLines(a, b) if !lines.is_empty() => lines.swap(a % n, b % n),
        Mutation::Shift(k, indent) if !lines.is_empty() => {
            let line = &mut lines[k % n];
            if *indent {
                line.insert_str(0, "  ");
            } else if line.starts_with("  ") {
                line.replace_range(..2, "");
            }
        }
        _ => {}
    }
    lines.join("\n") + "\n"
}

/// Parse and validate as `dflash show` does (no kind checks) or, with `kind_checks`, as `dflash
/// plan` does from the repository's root (the kinds' own checks: relations, upstream params,
/// files that must exist, a model missing here among them); render a refusal as the CLI does.
fn parse_and_render(name: &str, text: String, kind_checks: bool) {
    let registry = dflash::kinds::Registry::builtin();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let checks = kind_checks.then_some(dflash::pipeline::KindChecks {
        cwd: root,
        only: &[],
    });
    if let Err(problems) = dflash::pipeline::parse(
        name,
        &root.join("pipelines").join(name),
        text,
        &registry,
        checks,
    ) {
        let mut shown = String::new();
        miette::GraphicalReportHandler::new()
            .render_report(&mut shown, &problems)
            .expect("a refusal renders");
        assert!(!shown.trim().is_empty(), "a refusal says something");
    }
}

#[test]
fn the_shipped_pipelines_parse() {
    for (name, text) in shipped() {
        let registry = dflash::kinds::Registry::builtin();
        if let Err(p) = dflash::pipeline::parse(&name, Path::new(&name), text, &registry, None) {
            let mut shown = String::new();
            miette::GraphicalReportHandler::new()
                .render_report(&mut shown, &p)
                .unwrap();
            panic!("{name} is refused:\n{shown}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn mutated_pipelines_are_refused_or_taken_never_panic(
        file in any::<usize>(),
        mutations in proptest::collection::vec(mutation(), 1..4),
        kind_checks in any::<bool>(),
    ) {
        let files = shipped();
        let (name, text) = &files[file % files.len()];
        let mut text = text.clone();
        for m in &mutations {
            text = apply(&text, m);
        }
        parse_and_render(name, text, kind_checks);
    }
}
