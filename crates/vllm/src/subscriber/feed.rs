//! One publisher's stream inside a subscriber: its sequencer, its counters, and how each
//! [`Action`] is carried out against the sink.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kvroute_core::event::KvEvent;
use kvroute_core::index::EndpointId;
use parking_lot::Mutex;
use serde::Serialize;
use tracing::{debug, info, warn};

use super::EventSink;
use super::log_limit::{LogLimiter, Verdict};
use super::sequencer::{Action, Sequencer};
use crate::codec::{RawMessage, decode_batch};
use crate::zmtp::ZmtpError;

/// Running counters of one endpoint's event stream, for operators and tests.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct FeedStats {
    /// Whether the PUB connection is up now.
    pub connected: bool,
    /// Whether the PUB connection is up and no replay is in flight since it came up: every batch
    /// the engine still buffers has been applied (a replica is warm).
    pub caught_up: bool,
    /// Successful (re)connections.
    pub connects: u64,
    /// Connections lost.
    pub disconnects: u64,
    /// Batches decoded and applied.
    pub batches: u64,
    /// Events applied.
    pub events: u64,
    /// Blocks named by applied `BlockStored` events.
    pub blocks_stored: u64,
    /// Blocks named by applied `BlockRemoved` events.
    pub blocks_removed: u64,
    /// `AllBlocksCleared` events applied.
    pub clears: u64,
    /// Events of a type this version of kvroute does not know (skipped).
    pub unknown_events: u64,
    /// Payloads that failed to decode (skipped, logged).
    pub decode_errors: u64,
    /// Messages whose frames were not `[topic, seq, payload]` (the two kinds below together).
    pub framing_errors: u64,
    /// Messages with a frame count other than 3.
    pub bad_frame_count: u64,
    /// Messages whose sequence frame was not 8 bytes.
    pub bad_sequence_length: u64,
    /// Messages whose topic was not the expected one.
    pub topic_mismatches: u64,
    /// Publisher connections dropped because the publisher broke ZMTP (a bad greeting or
    /// command, an incompatible socket type) or the size limits; `oversized_messages` of them
    /// for size.
    pub protocol_errors: u64,
    /// Publisher connections dropped for a frame or message over the configured maximum
    /// (declared, so nothing was buffered for it).
    pub oversized_messages: u64,
    /// Gaps seen in the live sequence.
    pub gaps: u64,
    /// Replay requests sent (tail checks included).
    pub replays: u64,
    /// Batches received from replay and applied.
    pub replayed_batches: u64,
    /// Replays asked for because the stream went quiet ([`Timing::tail_check_after`]), in case
    /// its last batches were dropped with nothing after them to show it.
    ///
    /// [`Timing::tail_check_after`]: super::Timing::tail_check_after
    pub tail_checks: u64,
    /// Gaps that replay could not fill.
    pub unfilled_gaps: u64,
    /// Batches lost: in unfilled gaps, or undecodable.
    pub lost_batches: u64,
    /// Engine restarts detected (sequence went backwards).
    pub restarts: u64,
    /// Last applied sequence number.
    pub last_seq: Option<u64>,
    /// Engine timestamp of the last applied batch (seconds since the Unix epoch).
    pub last_batch_ts: Option<f64>,
    /// When the last batch was applied, by this machine's clock (ms since the Unix epoch).
    pub last_applied_unix_ms: Option<u64>,
}

/// One publisher's stream.
pub(crate) struct Feed {
    pub(crate) endpoint: EndpointId,
    pub(crate) name: String,
    pub(crate) sequencer: Sequencer,
    pub(crate) stats: Arc<Mutex<FeedStats>>,
    pub(crate) sink: Arc<dyn EventSink>,
    /// Limits the warnings about this stream's bad input.
    pub(crate) bad_input_log: LogLimiter,
    /// Event types of a newer vLLM already logged (each is logged once, then only counted).
    unknown_types_logged: HashSet<String>,
}

/// Distinct unknown event types logged per stream; more are only counted.
const MAX_UNKNOWN_TYPES_LOGGED: usize = 16;

impl Feed {
    pub(crate) fn new(
        endpoint: EndpointId,
        name: String,
        can_replay: bool,
        sink: Arc<dyn EventSink>,
        held_bytes: usize,
    ) -> Self {
        Self {
            endpoint,
            name,
            sequencer: Sequencer::new(can_replay).holding_at_most(held_bytes),
            stats: Arc::default(),
            sink,
            bad_input_log: LogLimiter::new(),
            unknown_types_logged: HashSet::new(),
        }
    }

    /// Records a failed or ended publisher connection; a protocol violation is counted and
    /// logged here (rate-limited), and `true` says so; anything else is left to the caller.
    pub(crate) fn connection_failed(&mut self, error: &ZmtpError) -> bool {
        if !error.is_protocol_violation() {
            return false;
        }
        self.count_protocol_error(error.is_too_large(), error);
        true
    }

    /// Counts a connection (live or replay) dropped because its peer broke the protocol or the
    /// size limits, and logs it, rate-limited.
    pub(crate) fn count_protocol_error(&mut self, oversized: bool, error: &dyn std::fmt::Display) {
        {
            let mut stats = self.stats.lock();
            stats.protocol_errors += 1;
            stats.oversized_messages += u64::from(oversized);
        }
        if let Verdict::Log { suppressed } = self.bad_input_log.check(Instant::now()) {
            warn!(endpoint = %self.name, %error, suppressed,
                "KV-event publisher broke the protocol; dropping its connection and reconnecting with backoff");
        }
    }

    /// Carries out the sequencer's actions; returns the replay to request, if any.
    pub(crate) fn execute(&mut self, actions: Vec<Action>, replayed: bool) -> Option<u64> {
        let mut replay = None;
        for action in actions {
            match action {
                Action::Apply(msg) => self.apply(&msg, replayed),
                Action::Gap { from, to } => {
                    info!(endpoint = %self.name, from, to, "gap in KV-event sequence");
                    self.stats.lock().gaps += 1;
                }
                Action::RequestReplay(from) => {
                    self.stats.lock().replays += 1;
                    debug!(endpoint = %self.name, from, "requesting replay");
                    replay = Some(from);
                }
                Action::Purge => {
                    warn!(endpoint = %self.name, "event sequence went backwards: engine restarted, dropping its cached blocks");
                    self.stats.lock().restarts += 1;
                    self.sink.purge(self.endpoint);
                }
                Action::UnfilledGap { from, to } => {
                    warn!(endpoint = %self.name, from, to, "KV events lost and not replayable: this endpoint's cache picture may be stale");
                    let mut stats = self.stats.lock();
                    stats.unfilled_gaps += 1;
                    // A hostile sequence may name a gap of nearly 2^64 batches, again and again.
                    stats.lost_batches = stats
                        .lost_batches
                        .saturating_add(to.saturating_sub(from).saturating_add(1));
                    self.sink.unfilled_gap(self.endpoint, from, to);
                }
            }
        }
        replay
    }

    fn apply(&mut self, msg: &RawMessage, replayed: bool) {
        match decode_batch(&msg.payload) {
            Ok(decoded) => {
                for unknown in &decoded.unknown_events {
                    let first = self.unknown_types_logged.len() < MAX_UNKNOWN_TYPES_LOGGED
                        && self.unknown_types_logged.insert(unknown.clone());
                    if first {
                        info!(endpoint = %self.name, event_type = %unknown, "skipping KV events of an unknown type (logged once per type; counted in unknown_events)");
                    }
                }
                self.sink.apply(self.endpoint, msg.seq, &decoded.batch);
                let mut stats = self.stats.lock();
                stats.batches += 1;
                stats.replayed_batches += u64::from(replayed);
                stats.unknown_events += decoded.unknown_events.len() as u64;
                stats.events += decoded.batch.events.len() as u64;
                for event in &decoded.batch.events {
                    match event {
                        KvEvent::BlockStored(e) => {
                            stats.blocks_stored += e.block_hashes.len() as u64
                        }
                        KvEvent::BlockRemoved(e) => {
                            stats.blocks_removed += e.block_hashes.len() as u64
                        }
                        KvEvent::AllBlocksCleared => stats.clears += 1,
                    }
                }
                stats.last_seq = Some(msg.seq);
                stats.last_batch_ts = Some(decoded.batch.ts);
                stats.last_applied_unix_ms = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .ok()
                    .map(|d| d.as_millis() as u64);
            }
            Err(e) => {
                // Its sequence number is used up, so no replay asks for it again: its events
                // are lost, and the fleet is told the picture may be stale.
                {
                    let mut stats = self.stats.lock();
                    stats.decode_errors += 1;
                    stats.lost_batches = stats.lost_batches.saturating_add(1);
                }
                self.sink.unfilled_gap(self.endpoint, msg.seq, msg.seq);
                if let Verdict::Log { suppressed } = self.bad_input_log.check(Instant::now()) {
                    warn!(endpoint = %self.name, seq = msg.seq, error = %e, suppressed, "dropping undecodable KV-event batch: this endpoint's cache picture may be stale");
                }
            }
        }
    }
}
