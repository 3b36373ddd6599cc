//! The sequence-number logic of one publisher's stream, without any I/O.
//!
//! vLLM numbers its batches 0, 1, 2, ... per process. The sequencer decides, for each message
//! that arrives live or from a replay, whether to apply it, skip it as a duplicate, ask for a
//! replay (a gap, a fresh connection, or a stream gone quiet), report a gap that replay could
//! not fill, or purge the endpoint because the engine restarted (the sequence went backwards).
//!
//! A gap on the live stream shows only when a later batch arrives. A PUB socket drops what
//! overflows its high-water mark, so the last batches of a burst can be lost with nothing after
//! them to tell; a stream that goes quiet therefore asks the replay socket for anything after
//! the last batch it applied ([`Sequencer::on_quiet`]; when, is the transport's choice).

use std::collections::BTreeMap;

use crate::codec::RawMessage;

/// Live messages held while a replay is in flight; past this the replay is abandoned.
const MAX_PENDING: usize = 10_000;

/// Bytes (topic and payload) held while a replay is in flight, unless set otherwise
/// ([`Sequencer::holding_at_most`]): four messages of the default size limit, what the
/// subscriber's queue holds.
const DEFAULT_MAX_HELD_BYTES: usize =
    super::QUEUED_LARGEST_MESSAGES * crate::zmtp::DEFAULT_MAX_MESSAGE_BYTES;

/// What the transport must do next, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Decode and apply this batch.
    Apply(RawMessage),
    /// Ask the engine's replay socket for every batch from this sequence on.
    RequestReplay(u64),
    /// The engine restarted: drop everything the index holds for it.
    Purge,
    /// Batches `from..=to` were missed on the live stream (a replay request follows if possible).
    Gap {
        /// First missing sequence.
        from: u64,
        /// Last missing sequence.
        to: u64,
    },
    /// Batches `from..=to` are lost for good (no replay socket, or no longer buffered).
    UnfilledGap {
        /// First missing sequence.
        from: u64,
        /// Last missing sequence.
        to: u64,
    },
}

#[derive(Debug)]
struct Replay {
    requested: u64,
    seen_any: bool,
    /// Asked for because the stream went quiet, not for a known gap: a live batch that
    /// follows the last one applied shows nothing was lost, and ends it.
    tail: bool,
    /// Replays in a row for the same hole (a reply can predate live messages held meanwhile).
    attempt: u8,
}

/// Replays tried for one hole before it is declared lost.
const MAX_ATTEMPTS: u8 = 3;

/// Sequence state of one publisher.
#[derive(Debug)]
pub struct Sequencer {
    can_replay: bool,
    next: Option<u64>,
    /// Highest sequence seen on the live stream (restart detection).
    last_live: Option<u64>,
    /// The lowest sequence the live stream may carry on this connection: every batch below it
    /// was accounted for before the connection was made (applied, replayed, or in a snapshot),
    /// so one of the same process is never below it, and a live batch below it is a new
    /// process's (restart detection before any live batch was seen).
    floor: Option<u64>,
    replay: Option<Replay>,
    pending: BTreeMap<u64, RawMessage>,
    /// Bytes of `pending`, topics and payloads.
    held_bytes: usize,
    /// Past this many held bytes, the replay is abandoned.
    max_held_bytes: usize,
}

impl Sequencer {
    /// A sequencer for a publisher with (or without) a replay socket.
    pub fn new(can_replay: bool) -> Self {
        Self {
            can_replay,
            next: None,
            last_live: None,
            floor: None,
            replay: None,
            pending: BTreeMap::new(),
            held_bytes: 0,
            max_held_bytes: DEFAULT_MAX_HELD_BYTES,
        }
    }

    /// Holds at most `bytes` of live messages (topics and payloads) while a replay is in flight
    /// (one message more is held whatever its size); past them the replay is abandoned, as a
    /// replay that never answers would leave them growing.
    pub fn holding_at_most(mut self, bytes: usize) -> Self {
        self.max_held_bytes = bytes;
        self
    }

    /// Keeps `msg` until the replay is over.
    fn keep(&mut self, msg: RawMessage) {
        let size = msg.frame_bytes();
        if let Some(old) = self.pending.insert(msg.seq, msg) {
            self.held_bytes -= old.frame_bytes();
        }
        self.held_bytes += size;
    }

    /// The first message kept, taken out.
    fn take_first(&mut self) -> Option<(u64, RawMessage)> {
        let first = self.pending.pop_first();
        if let Some((_, msg)) = &first {
            self.held_bytes -= msg.frame_bytes();
        }
        first
    }

    /// The next sequence number expected, if any batch was seen.
    pub fn next_expected(&self) -> Option<u64> {
        self.next
    }

    /// Whether a replay is in flight.
    pub fn replaying(&self) -> bool {
        self.replay.is_some()
    }

    /// Whether a replay other than a tail check is in flight: the stream is known to be behind
    /// (a gap, a fresh connection, a restart), not merely checked.
    pub fn catching_up(&self) -> bool {
        self.replay.as_ref().is_some_and(|r| !r.tail)
    }

    /// Starts from a known position: every batch up to `seq` is already accounted for (a
    /// snapshot of the index taken at `seq`, from another router replica). The first
    /// connection then replays from `seq + 1` rather than from 0.
    pub fn resume_after(&mut self, seq: u64) {
        self.next = Some(seq.saturating_add(1));
    }

    /// The subscription (re)connected: catch up on what was published meanwhile (everything
    /// still buffered, on a first connection).
    pub fn on_connect(&mut self) -> Vec<Action> {
        self.floor = self.next;
        if !self.can_replay || self.replay.is_some() {
            return Vec::new();
        }
        let from = self.next.unwrap_or(0);
        self.start_replay(from)
    }

    fn start_replay(&mut self, from: u64) -> Vec<Action> {
        self.start_attempt(from, 1)
    }

    fn start_attempt(&mut self, from: u64, attempt: u8) -> Vec<Action> {
        self.replay = Some(Replay {
            requested: from,
            seen_any: false,
            tail: false,
            attempt,
        });
        vec![Action::RequestReplay(from)]
    }

    /// The stream has been quiet for a while: ask the replay socket for anything published
    /// after the last batch applied, which a PUB socket may have dropped with nothing after it
    /// to show the gap. Asks nothing without a replay socket, while a replay is in flight, or
    /// before the connection's own replay has placed the stream.
    pub fn on_quiet(&mut self) -> Vec<Action> {
        let Some(next) = self.next else {
            return Vec::new();
        };
        if !self.can_replay || self.replay.is_some() {
            return Vec::new();
        }
        let actions = self.start_replay(next);
        if let Some(replay) = &mut self.replay {
            replay.tail = true;
        }
        actions
    }

    /// A message from the live PUB stream.
    pub fn on_live(&mut self, msg: RawMessage) -> Vec<Action> {
        // The live stream of one publisher process only ever moves forward, whatever replay
        // does meanwhile: a live sequence at or below the last live one means a new process,
        // and so does one below what was accounted for before this connection (an engine known
        // so far only through replay or a snapshot).
        let restarted = self.last_live.is_some_and(|last| msg.seq <= last)
            || self.floor.is_some_and(|floor| msg.seq < floor);
        self.last_live = Some(msg.seq);
        if restarted {
            return self.restart(msg);
        }
        match &self.replay {
            Some(replay) if replay.tail && replay.seen_any => self.hold(msg),
            // The batch after the last one applied: the quiet stream lost nothing, and its
            // live batches need not wait for the check's answer (a late one changes nothing).
            Some(replay) if replay.tail && self.next == Some(msg.seq) => {
                self.replay = None;
                self.accept(msg)
            }
            Some(_) => self.hold(msg),
            None => self.accept(msg),
        }
    }

    /// The engine restarted and counts from 0 again: purge, then catch up on what the new
    /// process published before we noticed.
    fn restart(&mut self, msg: RawMessage) -> Vec<Action> {
        self.next = None;
        self.floor = None;
        self.replay = None;
        self.pending.clear();
        self.held_bytes = 0;
        let mut actions = vec![Action::Purge];
        if self.can_replay && msg.seq > 0 {
            actions.extend(self.start_replay(0));
            self.keep(msg);
        } else {
            self.next = Some(msg.seq.saturating_add(1));
            actions.push(Action::Apply(msg));
        }
        actions
    }

    fn hold(&mut self, msg: RawMessage) -> Vec<Action> {
        self.keep(msg);
        if self.pending.len() > MAX_PENDING || self.held_bytes > self.max_held_bytes {
            // The replay is not coming; stop waiting rather than grow without bound.
            return self.on_replay_failed();
        }
        Vec::new()
    }

    /// Applies an in-order message, or reacts to a gap or a backwards step.
    fn accept(&mut self, msg: RawMessage) -> Vec<Action> {
        let seq = msg.seq;
        match self.next {
            None => {
                self.next = Some(seq.saturating_add(1));
                vec![Action::Apply(msg)]
            }
            Some(n) if seq == n => {
                self.next = Some(n.saturating_add(1));
                vec![Action::Apply(msg)]
            }
            // Already delivered by a replay that overtook the live stream.
            Some(n) if seq < n => Vec::new(),
            Some(n) if self.can_replay => {
                let mut actions = vec![Action::Gap {
                    from: n,
                    to: seq - 1,
                }];
                actions.extend(self.start_replay(n));
                self.keep(msg);
                actions
            }
            Some(n) => {
                self.next = Some(seq.saturating_add(1));
                vec![
                    Action::Gap {
                        from: n,
                        to: seq - 1,
                    },
                    Action::UnfilledGap {
                        from: n,
                        to: seq - 1,
                    },
                    Action::Apply(msg),
                ]
            }
        }
    }

    /// A batch from the replay socket.
    pub fn on_replayed(&mut self, msg: RawMessage) -> Vec<Action> {
        let Some(replay) = &mut self.replay else {
            return Vec::new(); // a late answer to an abandoned replay
        };
        let mut actions = Vec::new();
        let first = !replay.seen_any;
        replay.seen_any = true;
        let expected = self.next.unwrap_or(replay.requested);
        if first && msg.seq > expected {
            // The engine's buffer no longer holds what we asked for.
            actions.push(Action::UnfilledGap {
                from: expected,
                to: msg.seq - 1,
            });
            self.next = Some(msg.seq);
        }
        match self.next {
            Some(n) if msg.seq < n => {}
            Some(n) if msg.seq > n => {
                actions.push(Action::UnfilledGap {
                    from: n,
                    to: msg.seq - 1,
                });
                self.next = Some(msg.seq.saturating_add(1));
                actions.push(Action::Apply(msg));
            }
            _ => {
                self.next = Some(msg.seq.saturating_add(1));
                actions.push(Action::Apply(msg));
            }
        }
        actions
    }

    /// The replay's end marker: apply what arrived live meanwhile.
    pub fn on_replay_end(&mut self) -> Vec<Action> {
        let Some(replay) = self.replay.take() else {
            return Vec::new();
        };
        // Everything before the requested sequence is accounted for, even if nothing came back.
        let next = *self.next.get_or_insert(replay.requested);
        // A replay that filled its hole starts the count afresh for the next one, and a tail
        // check was no attempt at a hole found while it was in flight.
        let attempt = if next > replay.requested || replay.tail {
            0
        } else {
            replay.attempt
        };
        self.drain(attempt)
    }

    /// The replay failed or timed out: whatever it should have filled is lost, reported as
    /// such from the sequence it asked for (on a first connection or after a restart, from 0).
    pub fn on_replay_failed(&mut self) -> Vec<Action> {
        let Some(replay) = self.replay.take() else {
            return Vec::new();
        };
        self.next.get_or_insert(replay.requested);
        self.drain(MAX_ATTEMPTS)
    }

    /// Applies the live messages held during a replay. A hole left between them and the replay
    /// (its reply was taken before they were published) is asked for again, a few times at most.
    fn drain(&mut self, attempt: u8) -> Vec<Action> {
        let mut actions = Vec::new();
        while let Some((seq, msg)) = self.take_first() {
            match self.next {
                Some(n) if seq < n => {}
                Some(n) if seq > n && attempt < MAX_ATTEMPTS => {
                    self.keep(msg);
                    actions.extend(self.start_attempt(n, attempt + 1));
                    return actions;
                }
                Some(n) if seq > n => {
                    actions.push(Action::UnfilledGap {
                        from: n,
                        to: seq - 1,
                    });
                    self.next = Some(seq.saturating_add(1));
                    actions.push(Action::Apply(msg));
                }
                _ => actions.extend(self.accept(msg)),
            }
        }
        actions
    }
}

#[cfg(test)]
mod tests;
