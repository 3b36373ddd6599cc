//! Every routing decision of a simulated run, one JSON line each (`kvroute simulate
//! --log-decisions`): for a whole run, what `/kvroute/v1/explain` shows for one live request.
//! Each line names the request and its session, the endpoint it went to (and the prefill
//! endpoint of a disaggregated request), and the scheduler's decision: the ranking, the reason,
//! and every candidate's cost term by term.
//!
//! Writing never stops the run: the first error is kept, nothing more is written, and
//! [`DecisionLog::finish`] returns it, so a full disk cannot leave a truncated log that reads as
//! complete.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use kvroute_core::schedule::Decision;
use kvroute_core::schedule::disagg::DisaggExplain;
use serde::Serialize;

use crate::SimulateError;

/// A run's decisions, written as they are made.
pub struct DecisionLog {
    path: PathBuf,
    out: BufWriter<File>,
    error: Option<io::Error>,
}

/// One routing decision: a line of the log.
#[derive(Serialize)]
pub struct Decided<'a> {
    /// Virtual time of the decision, seconds from the start of the run.
    pub at_s: f64,
    /// The request, unique in the run.
    pub request: u64,
    /// Its conversation (or trace row).
    pub session: u64,
    /// Its prompt length in tokens.
    pub prompt_tokens: usize,
    /// The endpoint it was sent to (the decode endpoint of a disaggregated request), named as
    /// the results name it ([`crate::config::FleetConfig::endpoint_name`]).
    pub endpoint: String,
    /// The endpoint that computed its prefill, when it was disaggregated.
    pub prefill_endpoint: Option<String>,
    /// The scheduler's decision (its candidate ids are the endpoints' numbers: `engine-N`).
    pub decision: &'a Decision,
    /// The P/D choice and every option's arithmetic, where the policy priced one (`pd-cost`).
    pub pd_choice: Option<&'a DisaggExplain>,
}

impl DecisionLog {
    /// A log written to `path` (created, or truncated).
    pub fn create(path: &Path) -> Result<Self, SimulateError> {
        let file = File::create(path).map_err(|e| SimulateError::Io {
            path: path.to_owned(),
            source: e,
        })?;
        Ok(Self {
            path: path.to_owned(),
            out: BufWriter::new(file),
            error: None,
        })
    }

    /// Writes one decision (nothing once a write has failed).
    pub fn record(&mut self, decided: &Decided<'_>) {
        if self.error.is_some() {
            return;
        }
        let written = serde_json::to_writer(&mut self.out, decided)
            .map_err(io::Error::from)
            .and_then(|()| self.out.write_all(b"\n"));
        if let Err(e) = written {
            self.error = Some(e);
        }
    }

    /// Flushes the log; the first error met while writing it, if any.
    pub fn finish(mut self) -> Result<(), SimulateError> {
        let flushed = match self.error.take() {
            Some(e) => Err(e),
            None => self.out.flush(),
        };
        flushed.map_err(|e| SimulateError::Io {
            path: self.path,
            source: e,
        })
    }
}

#[cfg(test)]
mod tests {
    use kvroute_core::schedule::{Decision, Reason};

    use super::*;

    fn decision() -> Decision {
        Decision {
            ranking: Vec::new(),
            assessments: Vec::new(),
            reason: Reason::Cache,
            saturated: false,
            copy: None,
        }
    }

    fn decided(decision: &Decision) -> Decided<'_> {
        Decided {
            at_s: 1.5,
            request: 7,
            session: 3,
            prompt_tokens: 100,
            endpoint: "engine-2".into(),
            prefill_endpoint: None,
            decision,
            pd_choice: None,
        }
    }

    #[test]
    fn each_decision_is_one_line() {
        let dir = std::env::temp_dir().join(format!("kvroute-decisions-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("decisions.jsonl");
        let mut log = DecisionLog::create(&path).unwrap();
        let d = decision();
        log.record(&decided(&d));
        log.record(&decided(&d));
        log.finish().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert_eq!(lines[0]["endpoint"], "engine-2");
        assert_eq!(lines[0]["request"], 7);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A full disk is reported when the log is closed, not left as a log that reads complete.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_log_that_could_not_be_written_is_an_error() {
        let mut log = DecisionLog::create(Path::new("/dev/full")).unwrap();
        let d = decision();
        log.record(&decided(&d));
        let err = log.finish().unwrap_err();
        assert!(err.to_string().contains("/dev/full"), "{err}");
    }
}
