//! How fast training goes, for the people watching it: each step's wall time and tokens,
//! summed over a window (since the last report), as sequence and block tokens per second, the
//! time a step takes and the time left. Wall time only, never in the artifact: `metrics.jsonl`
//! and the stats stay the same bytes run after run (a resumed run's equal a straight one's), so
//! the figures go to the progress line and the stage's log.

use std::time::{Duration, Instant};

use dflash_stage_api::thousands;

/// One window's steps: their count, wall time (training only: evaluation and checkpoints are
/// timed apart) and tokens.
#[derive(Default)]
pub struct Pace {
    first: u64,
    steps: u64,
    seconds: f64,
    sequence_tokens: u64,
    block_tokens: u64,
    /// Evaluation and checkpoint time in this window.
    other_seconds: f64,
    /// Seconds a step over the whole run so far (for the time left).
    run_steps: u64,
    run_seconds: f64,
}

impl Pace {
    /// A pace whose first step is `first` (1-based; a resumed run's first step is past 1).
    pub fn starting_at(first: u64) -> Self {
        Self {
            first,
            ..Self::default()
        }
    }

    /// One training step done: its wall time since `started`, the tokens of its sequences and
    /// of its blocks.
    pub fn step(&mut self, started: Instant, sequence_tokens: u64, block_tokens: u64) {
        let s = started.elapsed().as_secs_f64();
        self.steps += 1;
        self.seconds += s;
        self.sequence_tokens += sequence_tokens;
        self.block_tokens += block_tokens;
        self.run_steps += 1;
        self.run_seconds += s;
    }

    /// Time spent on other work (an evaluation, a checkpoint) since `started`.
    pub fn other(&mut self, started: Instant) {
        self.other_seconds += started.elapsed().as_secs_f64();
    }

    /// Sequence tokens a second over the window (0 before its first step).
    pub fn tokens_per_second(&self) -> f64 {
        rate(self.sequence_tokens, self.seconds)
    }

    /// The run's seconds a step so far times the steps left (`None` before any step).
    pub fn left(&self, steps_left: u64) -> Option<Duration> {
        (self.run_steps > 0).then(|| {
            Duration::from_secs_f64(self.run_seconds / self.run_steps as f64 * steps_left as f64)
        })
    }

    /// The progress line's addition: `· 2,150 tok/s · 3m12s left`.
    pub fn progress(&self, steps_left: u64) -> String {
        let mut s = format!(" · {} tok/s", thousands(self.tokens_per_second()));
        if let Some(left) = self.left(steps_left).filter(|_| steps_left > 0) {
            s.push_str(&format!(" · {} left", duration(left)));
        }
        s
    }

    /// The window as one log line, then a new window from the next step:
    /// `steps 11-20 of 22: 1.42 s a step, 2,150 sequence tokens/s, 180 block tokens/s (evaluation
    /// and checkpoints 3.1 s)`. `None` for a window without steps.
    pub fn report(&mut self, total: u64) -> Option<String> {
        if self.steps == 0 {
            return None;
        }
        let last = self.first + self.steps - 1;
        let mut line = format!(
            "steps {}-{last} of {total}: {:.3} s a step, {} sequence tokens/s, {} block tokens/s",
            self.first,
            self.seconds / self.steps as f64,
            thousands(self.tokens_per_second()),
            thousands(rate(self.block_tokens, self.seconds)),
        );
        if self.other_seconds > 0.0 {
            line.push_str(&format!(
                " (evaluation and checkpoints {:.1} s)",
                self.other_seconds
            ));
        }
        *self = Self {
            first: last + 1,
            run_steps: self.run_steps,
            run_seconds: self.run_seconds,
            ..Self::default()
        };
        Some(line)
    }
}

/// One pace line of a stage log, read back (`dflash report` charts them).
#[derive(Clone, Debug, PartialEq)]
pub struct Window {
    /// The window's first step (1-based).
    pub first: u64,
    /// Its last step.
    pub last: u64,
    /// The run's steps.
    pub total: u64,
    /// Mean wall time of its training steps.
    pub seconds_per_step: f64,
    /// Tokens of its sequences a second.
    pub sequence_tokens_per_second: f64,
    /// Tokens of its blocks a second.
    pub block_tokens_per_second: f64,
}

impl Window {
    /// A line [`Pace::report`] wrote; `None` for any other line.
    pub fn parse(line: &str) -> Option<Self> {
        let rest = line.strip_prefix("steps ")?;
        let (range, rest) = rest.split_once(" of ")?;
        let (first, last) = range.split_once('-')?;
        let (total, rest) = rest.split_once(": ")?;
        let rest = rest.split(" (").next()?;
        let mut parts = rest.split(", ");
        let number = |p: Option<&str>, unit: &str| -> Option<f64> {
            p?.strip_suffix(unit)?.replace(',', "").parse().ok()
        };
        Some(Self {
            first: first.parse().ok()?,
            last: last.parse().ok()?,
            total: total.parse().ok()?,
            seconds_per_step: number(parts.next(), " s a step")?,
            sequence_tokens_per_second: number(parts.next(), " sequence tokens/s")?,
            block_tokens_per_second: number(parts.next(), " block tokens/s")?,
        })
    }
}

fn rate(tokens: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        tokens as f64 / seconds
    } else {
        0.0
    }
}

/// `45s`, `3m12s`, `5h04m`, `2d03h`.
fn duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86400, s % 86400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_written_as_people_read_them() {
        assert_eq!(duration(Duration::from_secs(45)), "45s");
        assert_eq!(duration(Duration::from_secs(192)), "3m12s");
        assert_eq!(duration(Duration::from_secs(5 * 3600 + 4 * 60)), "5h04m");
        assert_eq!(duration(Duration::from_secs(2 * 86400 + 3 * 3600)), "2d03h");
    }

    #[test]
    fn a_report_covers_its_window_and_starts_the_next() {
        let mut p = Pace::starting_at(11);
        assert_eq!(p.report(30), None, "no steps, no line");
        let t = Instant::now();
        p.step(t, 3000, 200);
        p.step(t, 3000, 200);
        let line = p.report(30).unwrap();
        assert!(line.starts_with("steps 11-12 of 30: "), "{line}");
        assert!(line.contains("sequence tokens/s") && line.contains("block tokens/s"));
        assert!(!line.contains("evaluation"), "{line}");
        p.step(t, 1, 1);
        p.other(t);
        let line = p.report(30).unwrap();
        assert!(line.starts_with("steps 13-13 of 30: "), "{line}");
        assert!(line.contains("(evaluation and checkpoints "), "{line}");
        assert!(p.left(10).unwrap() > Duration::ZERO);
    }

    #[test]
    fn a_report_line_reads_back() {
        let mut p = Pace::starting_at(1);
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(2) {}
        p.step(t, 3_000_000, 200);
        p.other(t);
        let rate = p.tokens_per_second();
        let line = p.report(9).unwrap();
        let w = Window::parse(&line).unwrap_or_else(|| panic!("{line}"));
        assert_eq!((w.first, w.last, w.total), (1, 1, 9));
        assert!(w.seconds_per_step >= 0.002, "{w:?}");
        // Written rounded to a token a second: read back within that.
        assert!(
            (w.sequence_tokens_per_second - rate).abs() <= 0.5,
            "{w:?} {rate}"
        );
        assert!(w.block_tokens_per_second > 0.0);
        assert_eq!(Window::parse("starting from the drafter in x"), None);
        assert_eq!(Window::parse("steps 1-2 of 3: soon"), None);
    }
}
