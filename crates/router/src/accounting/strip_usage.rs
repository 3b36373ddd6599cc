//! A stream whose usage the router asked for on its own account (`forwarding.stream_usage`:
//! the client's request named no `stream_options`), passed on without the usage event the
//! engine sends last, so that the client gets the stream it asked for. The accounting inside
//! ([`super::AccountedBody`]) has read the event by then.
//!
//! Events are passed on whole as they complete; only an event split across chunks waits for
//! its end (vLLM writes each event in one chunk), and one longer than [`MAX_HELD`] is passed on
//! unexamined, so nothing is held without bound.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use kvroute_vllm::openai::{is_usage_only_event, passes_unexamined, sse_event_end};

/// Most bytes of an incomplete event held back; past it they are passed on as they are (a
/// usage event is a few hundred bytes).
const MAX_HELD: usize = 64 * 1024;

/// A server-sent event stream with its usage-only event taken out.
pub struct StripUsage<B: Body> {
    inner: B,
    /// The start of an event not complete yet.
    held: BytesMut,
    /// What the inner body gave after the held bytes were due: passed on once they are.
    after: Option<Result<Frame<Bytes>, B::Error>>,
    /// The inner body ended (its end is passed on once the held bytes are).
    ended: bool,
}

impl<B: Body> StripUsage<B> {
    /// Wraps the stream `inner`.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            held: BytesMut::new(),
            after: None,
            ended: false,
        }
    }
}

impl<B> StripUsage<B>
where
    B: Body<Data = Bytes>,
{
    /// `data` joined to the held bytes: the complete events but a usage-only one, or `None`
    /// when nothing is to be passed on yet. A chunk of whole events without usage in it, with
    /// nothing held, is passed on as it is.
    fn pass(&mut self, data: Bytes) -> Option<Bytes> {
        if self.held.is_empty() && passes_unexamined(&data) {
            return Some(data);
        }
        self.held.extend_from_slice(&data);
        let mut out = BytesMut::new();
        let mut start = 0;
        while let Some(end) = sse_event_end(&self.held[start..]) {
            let event = &self.held[start..start + end];
            if !is_usage_only_event(event) {
                out.extend_from_slice(event);
            }
            start += end;
        }
        let _ = self.held.split_to(start);
        if self.held.len() > MAX_HELD {
            out.extend_from_slice(&self.held.split());
        }
        (!out.is_empty()).then(|| out.freeze())
    }

    /// The held bytes, passed on as they are (the stream ended without completing them).
    fn flush(&mut self) -> Option<Bytes> {
        (!self.held.is_empty()).then(|| self.held.split().freeze())
    }
}

impl<B> Body for StripUsage<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        loop {
            if let Some(next) = self.after.take() {
                return Poll::Ready(Some(next));
            }
            if self.ended {
                return Poll::Ready(self.flush().map(|data| Ok(Frame::data(data))));
            }
            match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        if let Some(out) = self.pass(data) {
                            return Poll::Ready(Some(Ok(Frame::data(out))));
                        }
                    }
                    // Trailers, after whatever was held.
                    Err(frame) => {
                        self.after = Some(Ok(frame));
                        if let Some(held) = self.flush() {
                            return Poll::Ready(Some(Ok(Frame::data(held))));
                        }
                    }
                },
                Poll::Ready(Some(Err(e))) => {
                    self.after = Some(Err(e));
                    if let Some(held) = self.flush() {
                        return Poll::Ready(Some(Ok(Frame::data(held))));
                    }
                }
                Poll::Ready(None) => self.ended = true,
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// Ended once nothing is held or waiting and the inner body ended, or says it has (so that
    /// the last frame carries the end, as it would without this wrapper).
    fn is_end_stream(&self) -> bool {
        self.after.is_none() && self.held.is_empty() && (self.ended || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, StreamBody};
    use proptest::prelude::*;
    use std::convert::Infallible;

    const TEXT: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
    const USAGE: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    /// The bytes a client gets of `chunks` through [`StripUsage`].
    async fn through(chunks: Vec<Vec<u8>>) -> Vec<u8> {
        let frames = chunks
            .into_iter()
            .map(|c| Ok::<_, Infallible>(Frame::data(Bytes::from(c))));
        let body = StripUsage::new(StreamBody::new(futures::stream::iter(frames)));
        body.collect().await.unwrap().to_bytes().to_vec()
    }

    /// `bytes` cut at `cuts` (positions, any order).
    fn cut(bytes: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
        let mut at: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        at.extend([0, bytes.len()]);
        at.sort_unstable();
        at.dedup();
        at.windows(2).map(|w| bytes[w[0]..w[1]].to_vec()).collect()
    }

    #[tokio::test]
    async fn the_usage_event_is_taken_out_and_the_rest_passed_on() {
        let stream = format!("{TEXT}{TEXT}{USAGE}{DONE}");
        let out = through(vec![stream.into_bytes()]).await;
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("{TEXT}{TEXT}{DONE}")
        );
    }

    #[tokio::test]
    async fn a_stream_that_ends_mid_event_is_passed_on_whole() {
        let out = through(vec![TEXT.into(), b"data: {\"choi".to_vec()]).await;
        assert_eq!(out, format!("{TEXT}data: {{\"choi").into_bytes());
    }

    #[tokio::test]
    async fn an_overlong_event_is_not_held_without_bound() {
        let long = vec![b'x'; MAX_HELD + 1];
        let frames = vec![Ok::<_, Infallible>(Frame::data(Bytes::from(long.clone())))];
        let mut body = StripUsage::new(StreamBody::new(futures::stream::iter(frames)));
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first.len(), long.len());
    }

    /// A body that says it ended with its last frame is passed on the same way, so that the
    /// last frame carries the end (over HTTP/2, no empty frame after it).
    #[tokio::test]
    async fn the_end_comes_with_the_last_frame() {
        let stream = format!("{TEXT}{USAGE}{DONE}");
        let mut body = StripUsage::new(http_body_util::Full::new(Bytes::from(stream)));
        assert!(!body.is_end_stream());
        let frame = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(frame, format!("{TEXT}{DONE}"));
        assert!(body.is_end_stream());
    }

    proptest! {
        /// However the engine's bytes are cut into chunks, the client gets them all but the
        /// usage event, in order.
        #[test]
        fn any_chunking_gives_the_client_the_same_stream(
            cuts in prop::collection::vec(any::<usize>(), 0..12),
            texts in 0usize..4,
        ) {
            let head = TEXT.repeat(texts);
            let stream = format!("{head}{USAGE}{DONE}");
            let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let out = runtime.block_on(through(cut(stream.as_bytes(), &cuts)));
            prop_assert_eq!(String::from_utf8(out).unwrap(), format!("{head}{DONE}"));
        }
    }
}
