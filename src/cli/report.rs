//! Reporters: how a run looks on stderr — progress bars on a terminal, one line per event
//! otherwise.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use crate::pipeline::Pipeline;
use crate::run::{Event, Reporter};
use crate::store::Status;

/// Pick the reporter for this stderr.
pub fn for_stderr() -> Box<dyn Reporter> {
    if std::io::stderr().is_terminal() {
        Box::new(Bars::default())
    } else {
        Box::new(Lines::every(progress_every()))
    }
}

/// Where stderr is no terminal (a log file, a `nohup` on a GPU box, CI), quiet about progress as
/// the CLI contract says, unless `DFLASH_PROGRESS_EVERY` asks for a running stage's progress
/// every so many seconds (0: at every progress event). A value that is not a number of seconds
/// is said, and ignored.
fn progress_every() -> Option<Duration> {
    let v = std::env::var("DFLASH_PROGRESS_EVERY").ok()?;
    match v.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s >= 0.0 => Some(Duration::from_secs_f64(s)),
        _ => {
            eprintln!(
                "warning: DFLASH_PROGRESS_EVERY={v:?} is not a number of seconds; no progress lines"
            );
            None
        }
    }
}

fn finished_line(
    pipeline: &Pipeline,
    stage: usize,
    result: &crate::store::StageResult,
    log: Option<&std::path::Path>,
) -> String {
    let spec = &pipeline.stages[stage];
    let key = result.key.map(|k| k.0.short(12)).unwrap_or_default();
    let width = super::id_width(pipeline);
    let mut line = format!(
        "{:<8} {:<width$} {:<10} {key:<12} {:>7.2}s",
        result.status.as_str(),
        spec.id,
        spec.kind,
        result.seconds
    );
    if let Some(e) = &result.error {
        let _ = write!(line, "  {e}");
    }
    if let Some(summary) = &result.summary {
        for l in summary.trim_end().lines() {
            if l.is_empty() {
                line.push('\n');
            } else {
                let _ = write!(line, "\n         {l}");
            }
        }
    }
    if let Some(h) = &result.hint {
        let _ = write!(line, "\n         hint: {h}");
    }
    if let (Status::Failed, Some(log)) = (result.status, log) {
        let _ = write!(line, "\n         log: {}", log.display());
    }
    line
}

/// A stage that a check against upstream data refused, said as soon as it is known.
fn doomed_line(pipeline: &Pipeline, stage: usize, error: &str) -> String {
    format!(
        "refused  {}: it will not run: {error}\n         the stages it reads from keep running; their work is kept\n",
        pipeline.stages[stage].id
    )
}

/// One line per event, for logs and CI; given `every`, a running stage's progress at most once
/// per `every` (the first after `every` has passed since it started), so a long training run
/// in a log file can say how it goes without flooding it.
pub struct Lines {
    every: Option<Duration>,
    /// When each running stage last printed (or started).
    last: std::collections::HashMap<usize, Instant>,
}

impl Lines {
    pub fn every(every: Option<Duration>) -> Self {
        Self {
            every,
            last: std::collections::HashMap::new(),
        }
    }
}

impl Reporter for Lines {
    fn event(&mut self, pipeline: &Pipeline, event: &Event) {
        let mut err = std::io::stderr().lock();
        let _ = match event {
            Event::RunStarted { run_id } => writeln!(
                err,
                "run {run_id}: {} ({} stages)",
                pipeline.name,
                pipeline.stages.len()
            ),
            Event::Started { stage } => {
                self.last.insert(*stage, Instant::now());
                writeln!(err, "started  {}", pipeline.stages[*stage].id)
            }
            Event::Progress {
                stage,
                done,
                total,
                message,
            } => match (self.last.get_mut(stage), self.every) {
                (Some(last), Some(every)) if last.elapsed() >= every => {
                    *last = Instant::now();
                    let of = total.map(|t| format!("/{t}")).unwrap_or_default();
                    writeln!(
                        err,
                        "progress {:<24} {done}{of} {message}",
                        pipeline.stages[*stage].id
                    )
                }
                _ => Ok(()),
            },
            Event::Finished { stage, result, log } => {
                self.last.remove(stage);
                writeln!(
                    err,
                    "{}",
                    finished_line(pipeline, *stage, result, log.as_deref())
                )
            }
            Event::Doomed { stage, error } => {
                writeln!(err, "{}", doomed_line(pipeline, *stage, error))
            }
            Event::Cancelling => writeln!(
                err,
                "cancelling: stopping running stages; finished shards are kept"
            ),
        };
    }
}

/// Progress bars on a terminal.
#[derive(Default)]
pub struct Bars {
    multi: MultiProgress,
    bars: std::collections::HashMap<usize, ProgressBar>,
}

impl Reporter for Bars {
    fn event(&mut self, pipeline: &Pipeline, event: &Event) {
        match event {
            Event::RunStarted { run_id } => {
                let _ = self.multi.println(format!(
                    "run {run_id}: {} ({} stages)",
                    pipeline.name,
                    pipeline.stages.len()
                ));
            }
            Event::Started { stage } => {
                let bar = self.multi.add(ProgressBar::new_spinner());
                bar.set_style(
                    ProgressStyle::with_template(
                        "{spinner} {prefix:<24} {wide_bar} {pos}/{len} {msg} {elapsed}",
                    )
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
                );
                bar.set_prefix(pipeline.stages[*stage].id.clone());
                bar.enable_steady_tick(Duration::from_millis(120));
                self.bars.insert(*stage, bar);
            }
            Event::Progress {
                stage,
                done,
                total,
                message,
            } => {
                if let Some(bar) = self.bars.get(stage) {
                    if let Some(t) = total {
                        bar.set_length(*t);
                    }
                    bar.set_position(*done);
                    bar.set_message(message.clone());
                }
            }
            Event::Finished { stage, result, log } => {
                if let Some(bar) = self.bars.remove(stage) {
                    bar.finish_and_clear();
                }
                let _ = self
                    .multi
                    .println(finished_line(pipeline, *stage, result, log.as_deref()));
            }
            Event::Doomed { stage, error } => {
                let _ = self.multi.println(doomed_line(pipeline, *stage, error));
            }
            Event::Cancelling => {
                let _ = self
                    .multi
                    .println("cancelling: stopping running stages; finished shards are kept");
            }
        }
    }
}
