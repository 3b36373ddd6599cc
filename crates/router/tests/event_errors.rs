//! A publisher sending malformed KV-event messages: the router counts them in its metrics by
//! kind, and its log stays quiet (a few warnings per interval, not one per message).

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::config_builder::{ConfigBuilder, endpoint};
use kvroute_router::server::start as start_router;
use kvroute_testkit::{eventually, http_get, sample};
use kvroute_vllm::subscriber::log_limit::PER_INTERVAL;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

/// Log output kept in memory.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn message(frames: &[&'static [u8]]) -> ZmqMessage {
    let mut msg = ZmqMessage::from(Bytes::from_static(frames[0]));
    for frame in &frames[1..] {
        msg.push_back(Bytes::from_static(frame));
    }
    msg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framing_errors_reach_the_metrics_and_the_log_stays_quiet() {
    let log = Captured::default();
    let writer = log.clone();
    tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .init();
    let mut publisher = PubSocket::new();
    let address = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap()
        .to_string();
    let mut e0 = endpoint(Some("e0".into()), "http://127.0.0.1:9");
    e0.events = Some(address);
    let router = start_router(ConfigBuilder::new("m").endpoint(e0).build())
        .await
        .unwrap();
    // Bad messages of both kinds, in bursts, until enough have arrived.
    let sender = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        loop {
            tick.tick().await;
            for _ in 0..20 {
                let _ = publisher.send(message(&[b"", b"payload"])).await;
                let _ = publisher
                    .send(message(&[b"", b"\0\0\0\x01", b"payload"]))
                    .await;
            }
        }
    });
    let counted = |text: &str, kind: &str| {
        sample(
            text,
            &format!("kvroute_kv_events{{endpoint=\"e0\",kind=\"{kind}\"}}"),
        )
        .unwrap_or(0.0)
    };
    let mut text = String::new();
    eventually("hundreds of bad messages of each kind in /metrics", || {
        text = http_get(router.admin_addr, "/metrics");
        let kinds = (
            counted(&text, "framing_errors"),
            counted(&text, "bad_frame_count"),
            counted(&text, "bad_sequence_length"),
        );
        (kinds.1 >= 200.0 && kinds.2 >= 200.0, kinds)
    })
    .await;
    sender.abort();
    assert!(counted(&text, "framing_errors") >= 400.0, "{text}");
    let logged = String::from_utf8_lossy(&log.0.lock().unwrap())
        .matches("dropping malformed KV-event message")
        .count();
    assert!(
        logged >= 1 && logged <= 2 * PER_INTERVAL as usize,
        "{logged} warnings for {} bad messages",
        counted(&text, "framing_errors")
    );
}
