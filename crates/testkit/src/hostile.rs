//! Hostile KV-event publishers. [`SilentPublisher`] completes the handshake and then sends
//! nothing, holding the connection open. The other, a TCP listener that speaks a valid ZMTP 3.1
//! handshake as a PUB
//! (or a replay ROUTER) and then, one attack per connection in turn, sends what must not take a subscriber down:
//! a frame header declaring 2^62 bytes, one declaring 8 GiB (followed by a MiB of its body),
//! and a multipart message whose frames each fit the limit but together exceed it. The wire
//! bytes are written here by hand, independently of kvroute's own ZMTP code.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// What one connection gets, in turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attack {
    /// A frame header declaring 2^62 bytes (the probe's abort).
    HugeFrame,
    /// A frame header declaring 8 GiB, then 1 MiB of body.
    EightGib,
    /// Three frames of `limit / 2` bytes each, in one message.
    OverLongMultipart,
}

/// The attacks, in the order connections get them.
pub const ATTACKS: [Attack; 3] = [
    Attack::HugeFrame,
    Attack::EightGib,
    Attack::OverLongMultipart,
];

/// The running publisher; dropping it stops it.
pub struct HostilePublisher {
    address: String,
    connections: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HostilePublisher {
    /// Listens on an ephemeral loopback port. Each connection is served in turn: handshake,
    /// `hold` of valid silence (so the subscriber reports itself connected for a while), then
    /// the next attack, sized for a subscriber whose message limit is `limit` bytes.
    pub fn start(limit: usize, hold: Duration) -> Self {
        Self::start_as("PUB", limit, hold)
    }

    /// [`HostilePublisher::start`], announcing `socket_type` (`ROUTER`: a hostile replay
    /// socket).
    pub fn start_as(socket_type: &'static str, limit: usize, hold: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let address = format!("tcp://{}", listener.local_addr().expect("bound address"));
        let connections = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (connections, stop) = (connections.clone(), stop.clone());
            std::thread::spawn(move || {
                for socket in listener.incoming() {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let Ok(socket) = socket else { continue };
                    let n = connections.fetch_add(1, Ordering::Relaxed);
                    let _ = attack(socket, socket_type, ATTACKS[n % ATTACKS.len()], limit, hold);
                }
            })
        };
        Self {
            address,
            connections,
            stop,
            thread: Some(thread),
        }
    }

    /// Where subscribers connect (`tcp://127.0.0.1:port`).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Connections accepted so far (one attack each).
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }
}

impl Drop for HostilePublisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accept loop so that it sees the flag.
        let _ = TcpStream::connect(self.address.trim_start_matches("tcp://"));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Connects to a bound subscriber at `address` (`tcp://host:port`) as a PUB and carries out
/// `attack` (sized for its message limit `limit`); returns once the subscriber hangs up (or
/// after 5 s of its silence).
pub fn attack_subscriber(address: &str, attack: Attack, limit: usize) -> std::io::Result<()> {
    let socket = TcpStream::connect(address.trim_start_matches("tcp://"))?;
    self::attack(socket, "PUB", attack, limit, Duration::ZERO)
}

/// A long (8-byte size) frame header.
fn long_header(flags: u8, size: u64) -> Vec<u8> {
    let mut header = vec![flags | 0x02];
    header.extend_from_slice(&size.to_be_bytes());
    header
}

/// The ZMTP 3.1 handshake as a `socket_type` server: greeting (signature, version 3.1,
/// mechanism NULL, as-server 0, filler), the peer's greeting, then READY with the socket type.
fn handshake(socket: &mut TcpStream, socket_type: &str) -> std::io::Result<()> {
    let mut greeting = [0u8; 64];
    greeting[0] = 0xFF;
    greeting[9] = 0x7F;
    greeting[10] = 3;
    greeting[11] = 1;
    greeting[12..16].copy_from_slice(b"NULL");
    socket.write_all(&greeting)?;
    let mut peer = [0u8; 64];
    socket.read_exact(&mut peer)?;
    // READY with the socket type: a command frame (flags 0x04).
    let mut ready = vec![0x04, 0, 5];
    ready.extend_from_slice(b"READY");
    ready.push(11);
    ready.extend_from_slice(b"Socket-Type");
    ready.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    ready.extend_from_slice(socket_type.as_bytes());
    ready[1] = (ready.len() - 2) as u8;
    socket.write_all(&ready)
}

/// A KV-event publisher that completes the handshake as a PUB and then publishes nothing,
/// counting the subscribers that hung up (or did not finish the handshake within 5 s): what tells whether a stopped subscriber really let
/// its connection go. Each connection's thread ends when it hangs up; the listening thread
/// runs until the process ends.
pub struct SilentPublisher {
    address: String,
    hung_up: Arc<AtomicUsize>,
}

impl SilentPublisher {
    /// Listens on an ephemeral loopback port.
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let address = format!("tcp://{}", listener.local_addr().expect("bound address"));
        let hung_up = Arc::new(AtomicUsize::new(0));
        let counter = hung_up.clone();
        std::thread::spawn(move || {
            for socket in listener.incoming() {
                let Ok(mut socket) = socket else { return };
                let counter = counter.clone();
                std::thread::spawn(move || {
                    // A handshake is due within 5 s; a subscriber that does not finish it has
                    // hung up as far as this publisher is concerned.
                    let greeted = socket
                        .set_read_timeout(Some(Duration::from_secs(5)))
                        .and_then(|()| handshake(&mut socket, "PUB"))
                        .and_then(|()| socket.set_read_timeout(None));
                    if greeted.is_ok() {
                        // The subscriber's bytes (its subscription, heartbeats) until it hangs up.
                        let mut sink = [0u8; 4096];
                        while matches!(socket.read(&mut sink), Ok(n) if n > 0) {}
                    }
                    counter.fetch_add(1, Ordering::Relaxed);
                });
            }
        });
        Self { address, hung_up }
    }

    /// Where subscribers connect (`tcp://127.0.0.1:port`).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Subscribers that hung up so far.
    pub fn hung_up(&self) -> usize {
        self.hung_up.load(Ordering::Relaxed)
    }
}

fn attack(
    mut socket: TcpStream,
    socket_type: &str,
    attack: Attack,
    limit: usize,
    hold: Duration,
) -> std::io::Result<()> {
    socket.set_read_timeout(Some(Duration::from_secs(5)))?;
    socket.set_write_timeout(Some(Duration::from_secs(5)))?;
    handshake(&mut socket, socket_type)?;
    std::thread::sleep(hold);
    match attack {
        Attack::HugeFrame => socket.write_all(&long_header(0, 1 << 62))?,
        Attack::EightGib => {
            socket.write_all(&long_header(0, 8 << 30))?;
            let chunk = vec![0xAB; 64 << 10];
            for _ in 0..16 {
                socket.write_all(&chunk)?;
            }
        }
        Attack::OverLongMultipart => {
            let frame = vec![0xCD; limit / 2];
            for i in 0..3 {
                let flags = if i < 2 { 0x01 } else { 0 };
                socket.write_all(&long_header(flags, frame.len() as u64))?;
                socket.write_all(&frame)?;
            }
        }
    }
    // Wait for the subscriber to hang up (or the timeout).
    let mut sink = [0u8; 4096];
    while socket.read(&mut sink)? > 0 {}
    Ok(())
}
