//! [`StageLog`]: the lines a stage appends to its log file (`StageContext::log_path`), which the
//! runtime keeps with the artifact and points at when the stage fails.

use std::io::Write;
use std::path::Path;

use crate::StageError;

/// A stage's log file, opened for appending.
pub struct StageLog(std::fs::File);

impl StageLog {
    /// Open (or create) the log at `path`.
    pub fn open(path: &Path) -> Result<Self, StageError> {
        Ok(Self(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?,
        ))
    }

    /// Append one line. A log that can't be written never fails the stage.
    pub fn line(&mut self, s: &str) {
        let _ = writeln!(self.0, "{s}");
    }
}
