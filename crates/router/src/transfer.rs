//! A decode leg's KV transfer, from the moment its leg is connected to its end: its bytes
//! queue on both endpoints' NICs in the fleet ([`Fleet::transfer_started`]) until the decode
//! leg's first token (the pull is done: the pair learns from the time it took, less the leg's
//! predicted wait in the decode queue, the engine step of its first token and a leg's fixed
//! cost: without them a fast link's few milliseconds would be judged with a step and a round
//! trip added, and a healthy pair struck as degraded, [`Fleet::observe_transfer`]), its failure
//! (a strike on the pair, [`Fleet::observe_failure`]), or the leg's end without any of those. A
//! non-streamed leg's first byte is its whole answer, long after the pull: its bytes leave the
//! NICs when the pair's link predicts the pull done ([`Fleet::transfer_unobserved`]), nothing
//! learned.
//!
//! [`Fleet::transfer_started`]: kvroute_core::fleet::Fleet::transfer_started
//! [`Fleet::transfer_unobserved`]: kvroute_core::fleet::Fleet::transfer_unobserved
//! [`Fleet::observe_transfer`]: kvroute_core::fleet::Fleet::observe_transfer
//! [`Fleet::observe_failure`]: kvroute_core::fleet::Fleet::observe_failure

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use kvroute_core::fleet::Plan;
use kvroute_core::index::EndpointId;
use kvroute_core::schedule::disagg::LinkHealth;
use kvroute_vllm::openai::is_stream_error_event;
use tokio::time::Instant;
use tracing::warn;

use crate::accounting::{Cut, CutAware};
use crate::metrics::pd::{PairLabels, pair};
use crate::service::Router;

/// Transfer ids, unique in this router.
static NEXT_TRANSFER: AtomicU64 = AtomicU64::new(1);

/// What a decode leg needs to track its transfer, whichever decode endpoint it lands on.
#[derive(Clone, Debug)]
pub(crate) struct DecodeLeg {
    /// The prefill endpoint holding the blocks.
    pub(crate) prefill: EndpointId,
    /// Prompt tokens.
    pub(crate) prompt_tokens: usize,
    /// Tokens per block.
    pub(crate) block_size: usize,
    /// What each endpoint holds of the prompt, as planned (the rest moves).
    pub(crate) decode_cached: HashMap<EndpointId, usize>,
    /// What the decode leg's first token takes besides the transfer: its predicted wait in the
    /// decode queue once the blocks arrive, the step that computes its first token, and a
    /// leg's fixed cost (a round trip).
    pub(crate) predicted_wait_s: f64,
    /// The client asked for a stream (the first body byte is the first token).
    pub(crate) stream: bool,
    /// When the producer's hold ends (Unix seconds), if it said.
    pub(crate) lease_until: Option<f64>,
    /// The client's own request, without KV-transfer parameters: what the next decode endpoint
    /// is sent when this one failed after taking the leg. It may have pulled the blocks, and
    /// the producer then released them (or reused them for another request), so a second pull
    /// could read another request's KV; computing the prompt again is always right.
    pub(crate) aggregated_body: Bytes,
    /// The request's plan: what serving it aggregated predicts and brings to the endpoint that
    /// computes it ([`Fleet::decode_leg_failed`](kvroute_core::fleet::Fleet::decode_leg_failed)).
    pub(crate) plan: Plan,
}

impl DecodeLeg {
    /// The decode leg was connected to `decode`: its transfer starts.
    pub(crate) fn start(&self, router: &Arc<Router>, decode: EndpointId) -> TransferWatch {
        let id = NEXT_TRANSFER.fetch_add(1, Ordering::Relaxed);
        let cached = self.decode_cached.get(&decode).copied().unwrap_or(0);
        let link = (self.prefill, decode);
        let now = router.now();
        let (bytes, dropped) = {
            let mut fleet = router.fleet();
            let bytes =
                fleet.transfer_started(id, link, self.prompt_tokens, cached, self.block_size, now);
            if !self.stream {
                // Its first byte is its whole answer, long after the pull: the bytes leave the
                // NICs when the link predicts the pull done.
                fleet.transfer_unobserved(id, now);
            }
            // A start is when core drops what expired or overflowed.
            (bytes, fleet.take_transfers_dropped())
        };
        router.metrics().pd.transfers_dropped(dropped);
        TransferWatch {
            names: (
                router.endpoint(self.prefill).name.clone(),
                router.endpoint(decode).name.clone(),
            ),
            router: router.clone(),
            id,
            link,
            bytes,
            sent: Instant::now(),
            predicted_wait_s: self.predicted_wait_s,
            learn: self.stream,
            done: false,
        }
    }

    /// Whether the producer's hold on the blocks still lasts, so that another decode endpoint
    /// may still pull them.
    pub(crate) fn may_retry(&self) -> bool {
        lease_holds(self.lease_until)
    }
}

/// One transfer in flight; its end is reported exactly once (on drop at the latest).
pub(crate) struct TransferWatch {
    router: Arc<Router>,
    id: u64,
    link: (EndpointId, EndpointId),
    /// The link's (prefill, decode) endpoint names, as the pair's series are labelled (read at
    /// the start: a departed endpoint's slot may be another's by the end).
    names: (String, String),
    bytes: f64,
    sent: Instant,
    predicted_wait_s: f64,
    learn: bool,
    done: bool,
}

impl TransferWatch {
    /// The decode leg's first body byte arrived: `data` is it. An error event there is a
    /// failed transfer hidden in a 200 (vLLM's `fail` policy on a stream).
    pub(crate) fn first_byte(&mut self, data: &[u8]) {
        if self.done {
            return;
        }
        let elapsed = self.sent.elapsed().as_secs_f64();
        let metrics = &self.router.metrics().pd;
        metrics.leg("decode", elapsed);
        if self.learn && is_stream_error_event(data) {
            metrics.fallback("decode_failed_in_stream");
            self.failed();
            return;
        }
        if !self.learn {
            // A whole answer: the transfer is over, its time is not told apart from decoding.
            self.ended();
            return;
        }
        self.done = true;
        let seconds = (elapsed - self.predicted_wait_s).max(0.0);
        let now = self.router.now();
        let (health, bandwidth) = {
            let mut fleet = self.router.fleet();
            fleet.observe_transfer(self.id, self.link, self.bytes, seconds, now);
            let links = fleet.links();
            (
                links.map(|l| l.health(self.link.0, self.link.1, now)),
                links.map_or(0.0, |l| l.bandwidth(self.link.0, self.link.1, now)),
            )
        };
        self.with_pair_series(|labels| {
            metrics
                .transfer_bytes
                .get_or_create(labels)
                .inc_by(self.bytes as u64);
            metrics
                .transfer_seconds
                .get_or_create(labels)
                .observe(seconds);
            self.publish(labels, health, bandwidth);
        });
    }

    /// The transfer failed (the decode leg failed after its prefill): a strike on the pair.
    pub(crate) fn failed(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        let now = self.router.now();
        let (health, bandwidth) = {
            let mut fleet = self.router.fleet();
            fleet.observe_failure(self.id, self.link, now);
            let links = fleet.links();
            (
                links.map(|l| l.health(self.link.0, self.link.1, now)),
                links.map_or(0.0, |l| l.bandwidth(self.link.0, self.link.1, now)),
            )
        };
        if matches!(health, Some(LinkHealth::Quarantined { .. })) {
            let (p, d) = &self.names;
            warn!(prefill = %p, decode = %d, "quarantining a prefill-decode pair whose transfers keep failing or crawling");
        }
        self.with_pair_series(|labels| {
            let metrics = &self.router.metrics().pd;
            metrics.transfer_failures.get_or_create(labels).inc();
            self.publish(labels, health, bandwidth);
        });
    }

    /// Writes the pair's series with `write`, unless either endpoint left the fleet meanwhile:
    /// the pair's series left with it and must not come back.
    fn with_pair_series(&self, write: impl FnOnce(&PairLabels)) {
        let (p, d) = &self.names;
        self.router
            .with_endpoint_series(&[p, d], || write(&pair(p, d)));
    }

    /// The transfer is over, its time unknown.
    pub(crate) fn ended(&mut self) {
        if !self.done {
            self.done = true;
            self.router.fleet().transfer_ended(self.id);
        }
    }

    fn publish(&self, labels: &PairLabels, health: Option<LinkHealth>, bandwidth: f64) {
        let shown = match health {
            Some(LinkHealth::Quarantined { .. }) => 0.0,
            _ => bandwidth,
        };
        self.router
            .metrics()
            .pd
            .link_bandwidth
            .get_or_create(labels)
            .set(shown);
    }
}

impl Drop for TransferWatch {
    fn drop(&mut self) {
        self.ended();
    }
}

/// A response body that shows its first data frame to a transfer watch, if any.
pub(crate) struct TransferBody<B> {
    inner: B,
    watch: Option<TransferWatch>,
}

impl<B> TransferBody<B> {
    /// `inner`, watched by `watch` (none: passed through).
    pub(crate) fn new(inner: B, watch: Option<TransferWatch>) -> Self {
        Self { inner, watch }
    }
}

impl<B> Body for TransferBody<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
            && let Some(mut watch) = self.watch.take()
        {
            watch.first_byte(data);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B> CutAware for TransferBody<B> {
    /// A decode leg the engine stalled or broke before its first byte (real vLLM sends a
    /// stream's headers before it pulls) is a failed transfer: a strike on its pair. A cut
    /// after it, or for the router's shutdown, says nothing of the pull.
    fn cut(&mut self, why: Cut) {
        if matches!(why, Cut::Stalled | Cut::EngineError)
            && let Some(mut watch) = self.watch.take()
        {
            watch.failed();
        }
    }
}

/// Whether a producer's hold that ends at `until` (Unix seconds; unknown: the release's lease,
/// many seconds) still holds now.
pub(crate) fn lease_holds(until: Option<f64>) -> bool {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    until.is_none_or(|until| now < until)
}
