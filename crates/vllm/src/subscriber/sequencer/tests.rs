use bytes::Bytes;
use proptest::prelude::*;

use super::*;

fn msg(seq: u64) -> RawMessage {
    RawMessage {
        topic: Bytes::new(),
        seq,
        payload: Bytes::from(seq.to_be_bytes().to_vec()),
    }
}

fn applied(actions: &[Action]) -> Vec<u64> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Apply(m) => Some(m.seq),
            _ => None,
        })
        .collect()
}

#[test]
fn first_connect_replays_from_zero_and_holds_live_messages() {
    let mut s = Sequencer::new(true);
    assert_eq!(s.on_connect(), vec![Action::RequestReplay(0)]);
    assert!(s.on_live(msg(3)).is_empty(), "held during replay");
    let mut out = Vec::new();
    for seq in 0..3 {
        out.extend(s.on_replayed(msg(seq)));
    }
    out.extend(s.on_replayed(msg(3))); // replay and live overlap
    out.extend(s.on_replay_end());
    assert_eq!(applied(&out), vec![0, 1, 2, 3]);
    assert_eq!(s.next_expected(), Some(4));
}

#[test]
fn resuming_after_a_snapshot_replays_only_what_followed_it() {
    let mut s = Sequencer::new(true);
    s.resume_after(5);
    assert_eq!(s.on_connect(), vec![Action::RequestReplay(6)]);
    assert!(s.on_live(msg(8)).is_empty(), "held during replay");
    let mut out = Vec::new();
    for seq in 6..8 {
        out.extend(s.on_replayed(msg(seq)));
    }
    out.extend(s.on_replay_end());
    assert_eq!(applied(&out), vec![6, 7, 8]);
    assert_eq!(applied(&s.on_live(msg(9))), vec![9]);
    // Without replay: the connection is made after the snapshot, so its live stream carries
    // batches that followed it; one the snapshot reflects is a new process's.
    let mut late = Sequencer::new(false);
    late.resume_after(5);
    assert!(late.on_connect().is_empty());
    assert_eq!(applied(&late.on_live(msg(6))), vec![6]);
    let mut restarted = Sequencer::new(false);
    restarted.resume_after(5);
    restarted.on_connect();
    assert_eq!(
        restarted.on_live(msg(5)),
        vec![Action::Purge, Action::Apply(msg(5))]
    );
}

#[test]
fn a_gap_asks_for_replay_from_the_first_missing_batch() {
    let mut s = Sequencer::new(true);
    s.on_connect();
    s.on_replay_end();
    assert_eq!(applied(&s.on_live(msg(0))), vec![0]);
    assert_eq!(
        s.on_live(msg(3)),
        vec![Action::Gap { from: 1, to: 2 }, Action::RequestReplay(1)]
    );
    let mut out = s.on_replayed(msg(1));
    out.extend(s.on_replayed(msg(2)));
    out.extend(s.on_replay_end());
    assert_eq!(applied(&out), vec![1, 2, 3]);
}

#[test]
fn a_replay_that_starts_late_reports_the_lost_range() {
    let mut s = Sequencer::new(true);
    s.on_connect();
    let out = s.on_replayed(msg(40));
    assert_eq!(out[0], Action::UnfilledGap { from: 0, to: 39 });
    assert_eq!(applied(&out), vec![40]);
}

#[test]
fn without_replay_a_gap_is_reported_and_the_stream_goes_on() {
    let mut s = Sequencer::new(false);
    assert!(s.on_connect().is_empty());
    s.on_live(msg(5));
    let out = s.on_live(msg(9));
    assert_eq!(out[0], Action::Gap { from: 6, to: 8 });
    assert_eq!(out[1], Action::UnfilledGap { from: 6, to: 8 });
    assert_eq!(applied(&out), vec![9]);
}

#[test]
fn a_quiet_stream_asks_for_what_followed_its_last_batch() {
    let mut s = Sequencer::new(true);
    s.on_connect();
    s.on_replay_end();
    s.on_live(msg(0));
    s.on_live(msg(1));
    // Batches 2 and 3 were dropped by the PUB socket and nothing came after them.
    assert_eq!(s.on_quiet(), vec![Action::RequestReplay(2)]);
    assert!(
        s.on_quiet().is_empty(),
        "one question while it is in flight"
    );
    let mut out = s.on_replayed(msg(2));
    out.extend(s.on_replayed(msg(3)));
    out.extend(s.on_replay_end());
    assert_eq!(applied(&out), vec![2, 3]);
    assert!(!out.iter().any(|a| matches!(a, Action::UnfilledGap { .. })));
    // Still quiet: asked again from after what the check brought (a batch may have been
    // published, and dropped, since).
    assert_eq!(s.on_quiet(), vec![Action::RequestReplay(4)]);
    assert!(s.on_replay_end().is_empty());
    assert_eq!(s.on_quiet(), vec![Action::RequestReplay(4)]);
}

#[test]
fn the_next_live_batch_ends_a_tail_check_without_waiting_for_it() {
    let mut s = Sequencer::new(true);
    s.on_connect();
    s.on_replay_end();
    s.on_live(msg(0));
    assert_eq!(s.on_quiet(), vec![Action::RequestReplay(1)]);
    // The engine publishes again, and its batch is the next one: nothing was lost.
    assert_eq!(applied(&s.on_live(msg(1))), vec![1]);
    assert!(!s.replaying());
    // The check's late answer changes nothing.
    assert!(s.on_replayed(msg(1)).is_empty());
    assert!(s.on_replay_end().is_empty());
    assert_eq!(applied(&s.on_live(msg(2))), vec![2]);
    // A live batch beyond the next one is a gap: it waits for the replay in flight.
    assert_eq!(s.on_quiet(), vec![Action::RequestReplay(3)]);
    assert!(s.on_live(msg(5)).is_empty(), "held");
    let mut out = s.on_replayed(msg(3));
    out.extend(s.on_replayed(msg(4)));
    out.extend(s.on_replayed(msg(5)));
    out.extend(s.on_replay_end());
    assert_eq!(applied(&out), vec![3, 4, 5]);
}

#[test]
fn a_tail_check_is_routine_and_spends_no_attempt_at_a_gap() {
    let mut s = Sequencer::new(true);
    s.on_connect();
    assert!(s.catching_up(), "a fresh connection's replay is");
    s.on_replay_end();
    s.on_live(msg(0));
    s.on_quiet();
    assert!(
        s.replaying() && !s.catching_up(),
        "a tail check is not being behind"
    );
    // A gap shows while the check is in flight; its answer (taken before 1 and 2 were
    // published) fills nothing. The gap then gets as many asks as any other.
    assert!(s.on_live(msg(3)).is_empty(), "held");
    let mut asked = 0;
    let mut out = s.on_replay_end();
    while let [Action::RequestReplay(1)] = out.as_slice() {
        asked += 1;
        assert!(s.catching_up());
        out = s.on_replay_end();
    }
    assert_eq!(asked, MAX_ATTEMPTS, "{out:?}");
    assert_eq!(out[0], Action::UnfilledGap { from: 1, to: 2 });
    assert_eq!(applied(&out), vec![3]);
}

#[test]
fn a_quiet_tail_the_engine_no_longer_buffers_is_reported_lost() {
    let mut s = Sequencer::new(true);
    s.on_connect();
    s.on_replay_end();
    s.on_live(msg(0));
    assert_eq!(s.on_quiet(), vec![Action::RequestReplay(1)]);
    let out = s.on_replayed(msg(30));
    assert_eq!(out[0], Action::UnfilledGap { from: 1, to: 29 });
    assert_eq!(applied(&out), vec![30]);
}

#[test]
fn a_quiet_stream_asks_nothing_without_replay_or_before_its_first_batch() {
    let mut none = Sequencer::new(false);
    none.on_live(msg(0));
    assert!(none.on_quiet().is_empty(), "no replay socket to ask");
    let mut fresh = Sequencer::new(true);
    assert_eq!(fresh.on_connect(), vec![Action::RequestReplay(0)]);
    assert!(
        fresh.on_quiet().is_empty(),
        "the connection's replay is in flight"
    );
    fresh.on_replay_end();
    assert_eq!(
        fresh.on_quiet(),
        vec![Action::RequestReplay(0)],
        "an engine that published nothing yet may have published since"
    );
    let mut never = Sequencer::new(true);
    assert!(never.on_quiet().is_empty(), "not connected yet");
}

#[test]
fn a_backwards_sequence_is_a_restart() {
    let mut s = Sequencer::new(false);
    s.on_live(msg(7));
    let out = s.on_live(msg(0));
    assert_eq!(out, vec![Action::Purge, Action::Apply(msg(0))]);
    // With replay, batches the new process published before we noticed are fetched.
    let mut s = Sequencer::new(true);
    s.on_connect();
    s.on_replay_end();
    s.on_live(msg(0));
    s.on_live(msg(1));
    s.on_live(msg(2));
    assert_eq!(
        s.on_live(msg(1)),
        vec![Action::Purge, Action::RequestReplay(0)]
    );
    let mut out = s.on_replayed(msg(0));
    out.extend(s.on_replayed(msg(1)));
    out.extend(s.on_replay_end());
    assert_eq!(applied(&out), vec![0, 1]);
}

#[test]
fn a_live_copy_of_a_replayed_batch_is_a_duplicate_not_a_restart() {
    let mut s = Sequencer::new(true);
    s.on_connect();
    s.on_replay_end();
    s.on_live(msg(0));
    s.on_live(msg(2));
    let mut out = s.on_replayed(msg(1));
    out.extend(s.on_replayed(msg(2)));
    out.extend(s.on_replayed(msg(3))); // replay overtakes the live stream
    out.extend(s.on_replay_end());
    assert_eq!(applied(&out), vec![1, 2, 3]);
    assert!(
        s.on_live(msg(3)).is_empty(),
        "late live copy of 3 is dropped"
    );
    assert_eq!(applied(&s.on_live(msg(4))), vec![4]);
}

#[test]
fn a_failed_replay_reports_the_gap_once_and_resumes() {
    let mut s = Sequencer::new(true);
    s.on_connect();
    s.on_replay_end();
    s.on_live(msg(0));
    s.on_live(msg(4));
    s.on_live(msg(5));
    let out = s.on_replay_failed();
    assert_eq!(out[0], Action::UnfilledGap { from: 1, to: 3 });
    assert_eq!(applied(&out), vec![4, 5]);
    assert!(!s.replaying());
    // A late answer to the abandoned replay changes nothing.
    assert!(s.on_replayed(msg(1)).is_empty());
}

/// A replay socket that buffers everything, and the generation filter `Stream` puts in front
/// of the sequencer: answers of a replay it has since replaced are dropped.
#[derive(Default)]
struct ReplayModel {
    /// Answers in flight, each with its replay's generation: a batch, or the end (`None`).
    answers: std::collections::VecDeque<(u64, Option<u64>)>,
    generation: u64,
}

impl ReplayModel {
    /// Queues the answers of every replay `actions` ask for, `published` batches out so far.
    fn requested(&mut self, actions: &[Action], published: u64) {
        for action in actions {
            if let Action::RequestReplay(from) = action {
                self.generation += 1;
                let g = self.generation;
                self.answers
                    .extend((*from..published).map(|seq| (g, Some(seq))));
                self.answers.push_back((g, None));
            }
        }
    }

    /// Delivers the next answer of the current replay, if any is left.
    fn answer(&mut self, s: &mut Sequencer) -> Option<Vec<Action>> {
        loop {
            let (g, item) = self.answers.pop_front()?;
            if g == self.generation {
                return Some(match item {
                    Some(seq) => s.on_replayed(msg(seq)),
                    None => s.on_replay_end(),
                });
            }
        }
    }
}

proptest! {
    /// With a replay socket that buffers everything, every batch is applied exactly once and in
    /// order, however many live messages are lost (the last ones too: the stream then goes
    /// quiet), whenever the stream is checked for a lost tail, and however replies interleave.
    #[test]
    fn lossy_live_stream_plus_replay_applies_everything_once_in_order(
        n in 1u64..120,
        drops in proptest::collection::vec(any::<bool>(), 120),
        quiet in proptest::collection::vec(proptest::bool::weighted(0.2), 120),
        interleave in proptest::collection::vec(0usize..4, 120),
    ) {
        let mut s = Sequencer::new(true);
        let mut out = Vec::new();
        let mut replay = ReplayModel::default();
        let a = s.on_connect();
        replay.requested(&a, 0);
        out.extend(a);
        for seq in 0..n {
            let published = seq + 1;
            if !drops[seq as usize] {
                let a = s.on_live(msg(seq));
                replay.requested(&a, published);
                out.extend(a);
            }
            if quiet[seq as usize] {
                let a = s.on_quiet();
                replay.requested(&a, published);
                out.extend(a);
            }
            for _ in 0..interleave[seq as usize] {
                let Some(a) = replay.answer(&mut s) else {
                    break;
                };
                replay.requested(&a, published);
                out.extend(a);
            }
        }
        // The publisher stopped: replies drain, the stream goes quiet and is checked, and the
        // check's replies drain.
        for check in [false, true] {
            if check {
                let a = s.on_quiet();
                replay.requested(&a, n);
                out.extend(a);
            }
            while let Some(a) = replay.answer(&mut s) {
                replay.requested(&a, n);
                out.extend(a);
            }
        }
        prop_assert_eq!(applied(&out), (0..n).collect::<Vec<_>>());
        let lost = out.iter().any(|a| matches!(a, Action::UnfilledGap { .. } | Action::Purge));
        prop_assert!(!lost, "nothing may be reported lost: {:?}", out);
    }
}

#[test]
fn live_messages_held_past_the_byte_bound_abandon_the_replay() {
    // msg() carries 8 payload bytes: 100 bytes hold twelve, the thirteenth is past the bound.
    let mut s = Sequencer::new(true).holding_at_most(100);
    s.resume_after(4);
    assert_eq!(s.on_connect(), vec![Action::RequestReplay(5)]);
    for seq in 10..22 {
        assert!(s.on_live(msg(seq)).is_empty(), "held during the replay");
    }
    assert!(s.replaying());
    let out = s.on_live(msg(22));
    assert!(
        !s.replaying(),
        "abandoned once the held bytes pass the bound"
    );
    assert_eq!(applied(&out), (10..=22).collect::<Vec<_>>());
    assert!(
        out.contains(&Action::UnfilledGap { from: 5, to: 9 }),
        "{out:?}"
    );
}

#[test]
fn held_topics_count_against_the_byte_bound() {
    // A topic frame costs memory as a payload does: two 60-byte topics pass 100 bytes.
    let mut s = Sequencer::new(true).holding_at_most(100);
    s.resume_after(4);
    s.on_connect();
    let with_topic = |seq| RawMessage {
        topic: Bytes::from(vec![b't'; 60]),
        ..msg(seq)
    };
    assert!(
        s.on_live(with_topic(10)).is_empty(),
        "held during the replay"
    );
    let out = s.on_live(with_topic(11));
    assert!(
        !s.replaying(),
        "abandoned once the held bytes pass the bound"
    );
    assert_eq!(applied(&out), vec![10, 11]);
}

/// An engine known only through a snapshot or a replay, which restarted before any live batch
/// came: its new process's first live batch is below what was accounted for, a restart.
#[test]
fn a_restart_is_seen_before_any_live_batch_came() {
    // Resumed after a peer's snapshot at 5000; the engine restarted since and is at 31.
    let mut s = Sequencer::new(true);
    s.resume_after(5000);
    assert_eq!(s.on_connect(), vec![Action::RequestReplay(5001)]);
    assert!(
        s.on_replay_end().is_empty(),
        "the new process holds nothing that high"
    );
    assert_eq!(
        s.on_live(msg(31)),
        vec![Action::Purge, Action::RequestReplay(0)]
    );
    let mut out = Vec::new();
    for seq in 0..31 {
        out.extend(s.on_replayed(msg(seq)));
    }
    out.extend(s.on_replay_end());
    assert_eq!(applied(&out), (0..=31).collect::<Vec<_>>());
    // History learned by replay only (an idle engine), then a restart: the old process's
    // connection ends, and the new one's first live batch is below what was accounted for.
    let mut s = Sequencer::new(true);
    s.on_connect();
    for seq in 0..100 {
        s.on_replayed(msg(seq));
    }
    s.on_replay_end();
    assert_eq!(s.on_connect(), vec![Action::RequestReplay(100)]);
    assert_eq!(
        s.on_live(msg(0)),
        vec![Action::Purge, Action::Apply(msg(0))]
    );
    assert!(
        s.on_replay_end().is_empty(),
        "the abandoned replay's end changes nothing"
    );
    // A reconnection to the same process: its live stream goes on from where it was.
    s.on_connect();
    s.on_replay_end();
    assert_eq!(applied(&s.on_live(msg(1))), vec![1]);
}

/// A replay from 0 (a first connection, or after a restart) that fails: the batches before the
/// first live one are reported lost, not passed over in silence.
#[test]
fn a_failed_replay_from_the_start_reports_what_it_should_have_filled() {
    let mut s = Sequencer::new(true);
    assert_eq!(s.on_connect(), vec![Action::RequestReplay(0)]);
    assert!(s.on_live(msg(7)).is_empty(), "held during the replay");
    let out = s.on_replay_failed();
    assert_eq!(out[0], Action::UnfilledGap { from: 0, to: 6 });
    assert_eq!(applied(&out), vec![7]);
}

#[test]
fn the_last_sequence_number_does_not_overflow() {
    let mut s = Sequencer::new(false);
    assert_eq!(applied(&s.on_live(msg(u64::MAX - 1))), vec![u64::MAX - 1]);
    assert_eq!(applied(&s.on_live(msg(u64::MAX))), vec![u64::MAX]);
    assert_eq!(s.next_expected(), Some(u64::MAX));
}
