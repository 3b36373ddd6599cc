use std::io::{BufRead, BufReader, Cursor};
use std::path::Path;

use super::*;

fn load(text: &str, options: &TraceOptions) -> Result<Vec<TraceRequest>, TraceError> {
    load_trace(Cursor::new(text.as_bytes()), options)
}

fn opts() -> TraceOptions {
    TraceOptions::default()
}

/// A small trace: rows 0 and 1 share their first two blocks, row 2 shares only the first.
const SMALL: &str = r#"{"timestamp": 0, "input_length": 1300, "output_length": 20, "hash_ids": [1, 2, 3]}
{"timestamp": 500, "input_length": 1100, "output_length": 30, "hash_ids": [1, 2, 4]}

{"timestamp": 1500, "input_length": 600, "output_length": 40, "hash_ids": [1, 5], "extra": true}
"#;

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[test]
fn equal_ids_give_equal_prefixes_and_different_ids_differ() {
    let requests = load(SMALL, &opts()).unwrap();
    assert_eq!(requests.len(), 3);
    let [a, b, c] = &requests[..] else {
        unreachable!()
    };
    assert_eq!(a.prompt.len(), 1300);
    assert_eq!(b.prompt.len(), 1100);
    assert_eq!(c.prompt.len(), 600);
    assert_eq!(
        [a.output_tokens, b.output_tokens, c.output_tokens],
        [20, 30, 40]
    );

    // Same two blocks, then different ids: the whole third block differs.
    assert_eq!(a.prompt[..1024], b.prompt[..1024]);
    assert_ne!(a.prompt[1024..1100], b.prompt[1024..1100]);
    assert!(common_prefix(&a.prompt, &b.prompt) < 1024 + 4);
    // Shares only the first block with both.
    assert_eq!(a.prompt[..512], c.prompt[..512]);
    assert_ne!(a.prompt[512..600], c.prompt[512..600]);
    assert_ne!(b.prompt[512..600], c.prompt[512..600]);

    // Token ids stay out of the reserved range.
    for r in &requests {
        assert!(
            r.prompt
                .iter()
                .all(|&t| (FIRST_TOKEN_ID..FIRST_TOKEN_ID + 32_000).contains(&t))
        );
    }
}

#[test]
fn loading_is_deterministic_and_seeded() {
    let one = load(SMALL, &opts()).unwrap();
    let two = load(SMALL, &opts()).unwrap();
    assert_eq!(one, two);
    let other = load(SMALL, &TraceOptions { seed: 7, ..opts() }).unwrap();
    assert_ne!(one[0].prompt[..512], other[0].prompt[..512]);
}

#[test]
fn the_last_block_is_a_prefix_of_the_full_block() {
    let text = r#"{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [9, 8]}
{"timestamp": 0, "input_length": 700, "output_length": 1, "hash_ids": [9, 8]}"#;
    let r = load(text, &opts()).unwrap();
    assert_eq!(r[1].prompt[..], r[0].prompt[..700]);
}

#[test]
fn small_vocab_and_block_size_are_honoured() {
    let options = TraceOptions {
        block_tokens: 4,
        vocab: 3,
        ..opts()
    };
    let text = r#"{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2, 3]}
{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]}"#;
    let r = load(text, &options).unwrap();
    assert_eq!(r[0].prompt.len(), 10);
    assert_eq!(r[0].prompt[..8], r[1].prompt[..]);
    assert!(r[0].prompt.iter().all(|&t| (256..259).contains(&t)));
}

#[test]
fn speed_scales_arrival_times() {
    let real = load(SMALL, &opts()).unwrap();
    let at: Vec<f64> = real.iter().map(|r| r.at_s).collect();
    assert_eq!(at, [0.0, 0.5, 1.5]);
    let fast = load(
        SMALL,
        &TraceOptions {
            speed: 2.0,
            ..opts()
        },
    )
    .unwrap();
    let at: Vec<f64> = fast.iter().map(|r| r.at_s).collect();
    assert_eq!(at, [0.0, 0.25, 0.75]);
    let slow = load(
        SMALL,
        &TraceOptions {
            speed: 0.5,
            ..opts()
        },
    )
    .unwrap();
    assert_eq!(slow[2].at_s, 3.0);
}

#[test]
fn limit_truncates() {
    let r = load(
        SMALL,
        &TraceOptions {
            limit: Some(2),
            ..opts()
        },
    )
    .unwrap();
    assert_eq!(r.len(), 2);
    assert_eq!(r[..], load(SMALL, &opts()).unwrap()[..2]);
    let none = load(
        SMALL,
        &TraceOptions {
            limit: Some(0),
            ..opts()
        },
    )
    .unwrap();
    assert!(none.is_empty());
}

#[test]
fn limit_stops_before_later_bad_lines() {
    // The first line is complete, the second is garbage: with limit 1 it is never read.
    let first = SMALL.lines().next().unwrap();
    let r = load(
        &format!("{first}\nthis is not json\n"),
        &TraceOptions {
            limit: Some(1),
            ..opts()
        },
    )
    .unwrap();
    assert_eq!(r.len(), 1);
}

#[test]
fn short_hash_id_lists_are_padded_with_unshared_blocks() {
    let text = r#"{"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [1]}
{"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [1]}
{"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [1, 2, 3]}"#;
    let r = load(text, &opts()).unwrap();
    for req in &r {
        assert_eq!(req.prompt.len(), 1500);
    }
    assert_eq!(r[0].prompt[..512], r[1].prompt[..512]);
    // Padding depends on the request, so the rest is not shared...
    assert_ne!(r[0].prompt[512..1024], r[1].prompt[512..1024]);
    // ...nor equal to any trace block.
    assert_ne!(r[0].prompt[512..1024], r[2].prompt[512..1024]);
    // Padding is deterministic too.
    assert_eq!(r, load(text, &opts()).unwrap());
}

#[test]
fn extra_hash_ids_are_ignored() {
    let text = r#"{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [1, 2, 3]}
{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [1]}"#;
    let r = load(text, &opts()).unwrap();
    assert_eq!(r[0], r[1]);
}

#[test]
fn empty_prompts_are_skipped_and_zero_outputs_become_one() {
    let text = r#"{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": []}
{"timestamp": 10, "input_length": 3, "output_length": 0, "hash_ids": [1]}"#;
    let r = load(text, &opts()).unwrap();
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].prompt.len(), 3);
    assert_eq!(r[0].output_tokens, 1);
    assert_eq!(r[0].at_s, 0.01);
}

#[test]
fn timestamps_never_go_back() {
    let text = r#"{"timestamp": 1000, "input_length": 3, "output_length": 1, "hash_ids": [1]}
{"timestamp": 400, "input_length": 3, "output_length": 1, "hash_ids": [2]}
{"timestamp": 2000.5, "input_length": 3, "output_length": 1, "hash_ids": [3]}"#;
    let r = load(text, &opts()).unwrap();
    let at: Vec<f64> = r.iter().map(|r| r.at_s).collect();
    assert_eq!(at, [1.0, 1.0, 2.0005]);
    // File order is kept.
    assert_eq!(r[1].prompt, load(text, &opts()).unwrap()[1].prompt);
}

fn error_of(text: &str) -> TraceError {
    load(text, &opts()).unwrap_err()
}

#[test]
fn bad_lines_name_the_line_and_the_problem() {
    let good = SMALL.lines().next().unwrap();

    let e = error_of(&format!("{good}\n{good}\nnot json\n"));
    assert!(matches!(e, TraceError::Json { line: 3, .. }), "{e:?}");
    assert!(e.to_string().starts_with("trace line 3:"), "{e}");

    let e = error_of(&format!(
        "{good}\n{{\"timestamp\": 0, \"output_length\": 1, \"hash_ids\": []}}\n"
    ));
    assert!(matches!(e, TraceError::Json { line: 2, .. }), "{e:?}");
    assert!(e.to_string().contains("input_length"), "{e}");

    let e =
        error_of(r#"{"timestamp": 0, "input_length": "many", "output_length": 1, "hash_ids": []}"#);
    assert!(matches!(e, TraceError::Json { line: 1, .. }), "{e:?}");

    let e = error_of(r#"{"timestamp": -5, "input_length": 1, "output_length": 1, "hash_ids": []}"#);
    assert!(matches!(e, TraceError::Invalid { line: 1, .. }), "{e:?}");
    assert!(e.to_string().contains("negative timestamp"), "{e}");

    let e = error_of(&format!(
        "{good}\n{{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 5000000000, \"hash_ids\": []}}"
    ));
    assert!(matches!(e, TraceError::Invalid { line: 2, .. }), "{e:?}");
    assert!(e.to_string().contains("output_length"), "{e}");

    let e = error_of(&format!(
        "{{\"timestamp\": 0, \"input_length\": {}, \"output_length\": 1, \"hash_ids\": []}}",
        MAX_INPUT_TOKENS + 1
    ));
    assert!(matches!(e, TraceError::Invalid { line: 1, .. }), "{e:?}");
}

#[test]
fn bad_options_are_rejected() {
    for options in [
        TraceOptions {
            speed: 0.0,
            ..opts()
        },
        TraceOptions {
            speed: f64::NAN,
            ..opts()
        },
        TraceOptions {
            block_tokens: 0,
            ..opts()
        },
        TraceOptions { vocab: 0, ..opts() },
    ] {
        assert!(matches!(load(SMALL, &options), Err(TraceError::Options(_))));
    }
}

#[test]
fn invalid_utf8_is_an_io_error_on_its_line() {
    let mut bytes = SMALL.lines().next().unwrap().as_bytes().to_vec();
    bytes.extend_from_slice(b"\n\xff\xfe\n");
    let e = load_trace(Cursor::new(bytes), &opts()).unwrap_err();
    assert!(matches!(e, TraceError::Io { line: 2, .. }), "{e:?}");
}

/// The Mooncake conversation trace, where CI has it; skipped when absent.
#[test]
fn shared_mooncake_trace_keeps_its_prefix_sharing() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/traces/mooncake-conversation.jsonl");
    let Ok(file) = std::fs::File::open(&path) else {
        return;
    };
    const N: usize = 500;
    let options = TraceOptions {
        limit: Some(N),
        ..opts()
    };
    let requests = load_trace(BufReader::new(file), &options).unwrap();
    assert_eq!(requests.len(), N);

    // The rows as written, to check the prompts against their hash ids.
    let rows: Vec<Row> = BufReader::new(std::fs::File::open(&path).unwrap())
        .lines()
        .take(N)
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect();
    let block = options.block_tokens;
    for (req, row) in requests.iter().zip(&rows) {
        assert_eq!(req.prompt.len() as u64, row.input_length);
        assert_eq!(req.at_s, row.timestamp / 1000.0);
        assert_eq!(u64::from(req.output_tokens), row.output_length.max(1));
    }
    let check = |i: usize, j: usize| {
        let (a, b) = (&requests[i], &requests[j]);
        let shared_ids = common_prefix_ids(&rows[i].hash_ids, &rows[j].hash_ids);
        let shared = (shared_ids * block).min(a.prompt.len()).min(b.prompt.len());
        assert_eq!(a.prompt[..shared], b.prompt[..shared], "rows {i} and {j}");
        // The first block with different ids differs (not just by chance in one token).
        let end = ((shared_ids + 1) * block)
            .min(a.prompt.len())
            .min(b.prompt.len());
        if end > shared {
            assert_ne!(
                a.prompt[shared..end],
                b.prompt[shared..end],
                "rows {i} and {j}"
            );
        }
    };
    let mut shared_pairs = 0;
    for i in 1..N {
        check(i - 1, i);
        for j in 0..16.min(i) {
            check(j, i);
            if rows[j].hash_ids.first() == rows[i].hash_ids.first() {
                shared_pairs += 1;
            }
        }
    }
    assert!(shared_pairs > 0, "the trace should share some prefixes");
}

fn common_prefix_ids(a: &[u64], b: &[u64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[test]
fn a_trace_asking_for_more_tokens_than_the_bound_is_refused_at_the_row_that_passes_it() {
    // SMALL asks for 1,300 + 1,100 + 600 tokens: the third row passes 2,500.
    let refused = load_trace_within(Cursor::new(SMALL.as_bytes()), &opts(), 2_500);
    match refused {
        Err(TraceError::Invalid { line: 4, problem }) => {
            assert!(problem.contains("2500 tokens"), "{problem}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        load_trace_within(Cursor::new(SMALL.as_bytes()), &opts(), 3_000)
            .unwrap()
            .len(),
        3
    );
}

#[test]
fn a_line_without_end_is_refused_at_the_bound() {
    let endless = BufReader::new(std::io::Read::take(std::io::repeat(b' '), 64 << 20));
    match load_trace(endless, &opts()) {
        Err(TraceError::Io { line: 1, source }) => {
            assert!(source.to_string().contains("longer than"), "{source}")
        }
        other => panic!("{other:?}"),
    }
}
