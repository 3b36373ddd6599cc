//! A publisher sending malformed KV-event messages: the router counts them in its metrics by
//! kind, and its log stays quiet (a few warnings per interval, not one per message).

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kvroute_router::config::RouterConfig;
use kvroute_router::server::start as start_router;
use kvroute_testkit::eventually;
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
    let yaml = format!(
        "listen: 127.0.0.1:0\nadmin: {{listen: 127.0.0.1:0}}\nmodels: [{{name: m}}]\nendpoints: [{{name: e0, url: 'http://127.0.0.1:9', events: '{address}'}}]\n"
    );
    let router = start_router(RouterConfig::from_yaml(&yaml).unwrap())
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
    let stats = || {
        router.router.endpoints[0]
            .subscriber
            .lock()
            .as_ref()
            .map(|s| s.stats()[0].1.clone())
            .unwrap_or_default()
    };
    eventually("hundreds of bad messages counted by kind", || {
        let s = stats();
        (s.bad_frame_count >= 200 && s.bad_sequence_length >= 200, s)
    })
    .await;
    sender.abort();
    let text = reqwest::get(format!("http://{}/metrics", router.admin_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for kind in ["framing_errors", "bad_frame_count", "bad_sequence_length"] {
        let series = format!("kvroute_kv_events{{endpoint=\"e0\",kind=\"{kind}\"}} ");
        let value: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix(&series))
            .unwrap_or_else(|| panic!("no {series} in {text}"))
            .parse()
            .unwrap();
        assert!(value >= 200.0, "{series}{value}");
    }
    let logged = String::from_utf8_lossy(&log.0.lock().unwrap())
        .matches("dropping malformed KV-event message")
        .count();
    assert!(
        logged >= 1 && logged <= 2 * PER_INTERVAL as usize,
        "{logged} warnings for {} bad messages",
        stats().framing_errors
    );
}
