//! [`StageError`]: how a stage reports failure to the runtime and the user.

use std::path::PathBuf;

/// A stage failed. The message is shown to the user; `help` says what to do about it.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
#[error("{message}")]
pub struct StageError {
    /// What went wrong, in one line.
    pub message: String,
    /// How to fix it, when known.
    #[help]
    pub help: Option<String>,
    /// Where the stage's full log is, when it has one.
    pub log: Option<PathBuf>,
    /// The run was cancelled (Ctrl-C) rather than failing on its own.
    pub cancelled: bool,
}

impl StageError {
    /// A failure with a message.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            help: None,
            log: None,
            cancelled: false,
        }
    }

    /// The stage stopped because the run was cancelled.
    pub fn cancelled() -> Self {
        Self {
            cancelled: true,
            ..Self::new("cancelled")
        }
    }

    /// Attach a hint.
    #[must_use]
    pub fn with_help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }

    /// Attach the path of the stage's log.
    #[must_use]
    pub fn with_log(mut self, log: impl Into<PathBuf>) -> Self {
        self.log = Some(log.into());
        self
    }
}

impl From<std::io::Error> for StageError {
    fn from(e: std::io::Error) -> Self {
        Self::new(e.to_string())
    }
}
