//! [`Problem`] and [`Problems`]: located pipeline errors, all reported together.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use miette::{Diagnostic, LabeledSpan, NamedSource, SourceCode};

/// One thing wrong with a pipeline file, pointing at the offending text.
#[derive(Debug)]
pub struct Problem {
    /// Namespaced code, e.g. `dflash::pipeline::unknown_kind`.
    pub code: &'static str,
    /// What is wrong.
    pub message: String,
    /// The offending bytes.
    pub span: Range<usize>,
    /// The label shown at the span.
    pub label: String,
    /// How to fix it, when known.
    pub help: Option<String>,
}

impl Problem {
    /// A problem at `span`.
    pub fn new(
        code: &'static str,
        message: impl Into<String>,
        span: Range<usize>,
        label: impl Into<String>,
    ) -> Self {
        Self {
            code,
            message: message.into(),
            span,
            label: label.into(),
            help: None,
        }
    }

    /// Add a hint.
    #[must_use]
    pub fn help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Problem {}

impl Diagnostic for Problem {
    fn code<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        Some(Box::new(self.code))
    }
    fn help<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.help
            .as_ref()
            .map(|h| Box::new(h) as Box<dyn fmt::Display>)
    }
    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        Some(Box::new(std::iter::once(LabeledSpan::new_with_span(
            Some(self.label.clone()),
            self.span.clone(),
        ))))
    }
}

/// Every problem found in one pipeline file.
#[derive(Debug)]
pub struct Problems {
    /// The file, for rendering.
    pub source: NamedSource<Arc<String>>,
    /// The problems, in file order.
    pub problems: Vec<Problem>,
}

impl fmt::Display for Problems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.problems.len();
        write!(
            f,
            "{} has {n} error{}",
            self.source.name(),
            if n == 1 { "" } else { "s" }
        )
    }
}

impl std::error::Error for Problems {}

impl Diagnostic for Problems {
    fn code<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        Some(Box::new("dflash::pipeline::invalid"))
    }
    fn source_code(&self) -> Option<&dyn SourceCode> {
        Some(&self.source)
    }
    fn related<'a>(&'a self) -> Option<Box<dyn Iterator<Item = &'a dyn Diagnostic> + 'a>> {
        Some(Box::new(self.problems.iter().map(|p| p as &dyn Diagnostic)))
    }
}

/// The closest of `options` to `word`, if close enough to suggest.
pub fn did_you_mean<'a>(word: &str, options: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    options
        .into_iter()
        .map(|o| (strsim::jaro_winkler(word, o), o))
        .filter(|(score, _)| *score > 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, o)| o)
}
