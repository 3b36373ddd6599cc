//! Request preparation off the async workers: parsing, tokenizing and planning a large body take
//! milliseconds to seconds of CPU, during which an async worker would serve nobody else. Bodies
//! of at least `limits.offload_above_bytes` are prepared on a bounded pool of blocking threads
//! (`limits.offload_threads` at once), with at most `limits.offload_queue` waiting; past that,
//! a request is shed (503, counted as `kvroute_shed_total{reason="offload_queue"}`) rather than
//! queued without bound. What a large request allocated while being prepared is freed on the
//! pool's thread when it is done, and the pool's bound caps how much of it exists at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::Semaphore;

/// The bounded pool, shared by every request.
pub struct Offload {
    threshold: usize,
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    max_waiting: usize,
    /// Requests on the pool or waiting for it (`kvroute_offload_requests`).
    gauge: Gauge,
}

/// The pool's queue is full: the request is shed.
#[derive(Debug)]
pub struct QueueFull;

/// Counts a waiting request until it gets a slot or is dropped.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Counts a request on the gauge while it is on the pool or waiting for it.
struct Counted(Gauge);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Offload {
    /// A pool for bodies of at least `threshold` bytes, `threads` working at once and at most
    /// `queue` waiting; `gauge` shows the requests in it.
    pub fn new(threshold: usize, threads: usize, queue: usize, gauge: Gauge) -> Self {
        Self {
            threshold,
            slots: Arc::new(Semaphore::new(threads.max(1))),
            waiting: AtomicUsize::new(0),
            max_waiting: queue,
            gauge,
        }
    }

    /// Whether a body of `bytes` is prepared on the pool.
    pub fn wanted(&self, bytes: usize) -> bool {
        bytes >= self.threshold
    }

    /// Runs `work` on a blocking thread once a slot is free; [`QueueFull`] at once when
    /// `limits.offload_queue` requests already wait.
    pub async fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, QueueFull> {
        self.gauge.inc();
        let _counted = Counted(self.gauge.clone());
        let permit = match self.slots.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                if self.waiting.fetch_add(1, Ordering::AcqRel) >= self.max_waiting {
                    self.waiting.fetch_sub(1, Ordering::AcqRel);
                    return Err(QueueFull);
                }
                let _waiting = Waiting(&self.waiting);
                self.slots
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("the pool's semaphore is never closed")
            }
        };
        let task = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            work()
        });
        match task.await {
            Ok(value) => Ok(value),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // Blocking tasks are not cancelled; the runtime is shutting down.
            Err(_) => Err(QueueFull),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn past_its_queue_the_pool_sheds() {
        let pool = Arc::new(Offload::new(0, 1, 1, Gauge::default()));
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let (started_tx, started) = tokio::sync::oneshot::channel();
        let busy = {
            let pool = pool.clone();
            tokio::spawn(async move {
                pool.run(move || {
                    let _ = started_tx.send(());
                    let _ = hold.recv();
                })
                .await
            })
        };
        started.await.unwrap();
        let queued = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.run(|| 2).await })
        };
        // The second waits (the queue holds one); a third is shed.
        while pool.waiting.load(Ordering::Acquire) == 0 {
            tokio::task::yield_now().await;
        }
        assert!(pool.run(|| 3).await.is_err());
        release.send(()).unwrap();
        busy.await.unwrap().unwrap();
        assert_eq!(queued.await.unwrap().unwrap(), 2);
        assert_eq!(pool.gauge.get(), 0);
    }
}
