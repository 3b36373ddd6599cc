//! The live driver of the [`crate::link::Fabric`]: one task per simulator process moves the
//! transfers of all its consumer engines in scaled real time, so concurrent pulls share links
//! as the model says.

use std::collections::HashMap;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::link::{Fabric, LinkSpec};

struct Start {
    src: String,
    dst: String,
    bytes: u64,
    slowdown: f64,
    done: oneshot::Sender<()>,
}

/// Starts transfers on the process's fabric.
#[derive(Clone, Debug)]
pub struct FabricHandle {
    tx: mpsc::UnboundedSender<Start>,
    time_scale: f64,
}

impl FabricHandle {
    /// Starts the fabric task on the current runtime.
    pub fn spawn(spec: LinkSpec, time_scale: f64) -> (Self, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(Fabric::new(spec), time_scale, rx));
        (Self { tx, time_scale }, task)
    }

    /// Moves `bytes` from NIC `src` to NIC `dst`; returns the engine seconds it took, or `None`
    /// when the fabric stopped.
    pub async fn transfer(&self, src: &str, dst: &str, bytes: u64, slowdown: f64) -> Option<f64> {
        let started = Instant::now();
        let (done, finished) = oneshot::channel();
        self.tx
            .send(Start {
                src: src.to_owned(),
                dst: dst.to_owned(),
                bytes,
                slowdown,
                done,
            })
            .ok()?;
        finished.await.ok()?;
        Some(started.elapsed().as_secs_f64() * self.time_scale)
    }
}

async fn run(mut fabric: Fabric, time_scale: f64, mut rx: mpsc::UnboundedReceiver<Start>) {
    let origin = Instant::now();
    let engine_now = || origin.elapsed().as_secs_f64() * time_scale;
    let mut waiters: HashMap<u64, oneshot::Sender<()>> = HashMap::new();
    loop {
        // Without transfers in flight, wait for one; otherwise until the next event at most.
        let wake = fabric
            .next_event()
            // A time beyond what a Duration holds is never: wait for a command instead.
            .and_then(|t| Duration::try_from_secs_f64(t.max(0.0) / time_scale).ok())
            .map(|after| origin + after);
        let command = match wake {
            None => rx.recv().await.map(Some),
            Some(at) => match tokio::time::timeout_at(at, rx.recv()).await {
                Ok(command) => command.map(Some),
                Err(_) => Some(None),
            },
        };
        match command {
            None => return,
            Some(Some(start)) => {
                let id = fabric.start(
                    engine_now(),
                    &start.src,
                    &start.dst,
                    start.bytes,
                    start.slowdown,
                );
                waiters.insert(id, start.done);
            }
            Some(None) => {}
        }
        for id in fabric.advance(engine_now()) {
            if let Some(done) = waiters.remove(&id) {
                let _ = done.send(());
            }
        }
        // A consumer that went away frees its share of the link.
        waiters.retain(|id, done| {
            let open = !done.is_closed();
            if !open {
                fabric.cancel(*id);
            }
            open
        });
    }
}
