//! One ZMTP connection over TCP on tokio: the handshake under a timeout, then messages in and
//! out, with heartbeats on peers that speak ZMTP 3.1.
//!
//! Every wait is bounded or cancellable: connecting and the handshake have timeouts, so do
//! writes, and [`Connection::recv`] is cancel-safe (dropping its future loses no byte). A live
//! feed may be legitimately silent for a long time (an idle engine publishes nothing), so
//! reads have no fixed timeout; instead, a 3.1 peer is sent a PING after `heartbeat.interval`
//! of silence and the connection fails after `heartbeat.timeout` (libzmq answers PING with
//! PONG whether or not it sends heartbeats itself). A 3.0 peer cannot be pinged: its silence is
//! only ended by the peer or by cancelling the read.

use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

use super::address::{TcpAddress, tcp_url};
use super::decoder::{Decoder, Item};
use super::wire::{
    self, Command, GREETING_LEN, encode_message, encode_ping, encode_pong, encode_ready,
    encode_subscription,
};
use super::{Limits, ZmtpError};

/// The socket types kvroute opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketType {
    /// Subscriber to a PUB or XPUB.
    Sub,
    /// Dealer to a ROUTER (or DEALER).
    Dealer,
}

impl SocketType {
    /// The name READY carries.
    pub fn name(self) -> &'static str {
        match self {
            SocketType::Sub => "SUB",
            SocketType::Dealer => "DEALER",
        }
    }

    /// Whether a peer of type `peer` may talk to this socket (RFC 23's valid combinations).
    pub fn accepts(self, peer: &[u8]) -> bool {
        match self {
            SocketType::Sub => matches!(peer, b"PUB" | b"XPUB"),
            SocketType::Dealer => matches!(peer, b"ROUTER" | b"DEALER"),
        }
    }
}

/// Heartbeats towards peers that speak ZMTP 3.1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heartbeat {
    /// Silence after which a PING is sent.
    pub interval: Duration,
    /// Silence after which the connection is dropped.
    pub timeout: Duration,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(10),
            timeout: Duration::from_secs(30),
        }
    }
}

/// How connections are made and what they may buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// How long a TCP connect may take.
    pub connect_timeout: Duration,
    /// How long the greeting and READY exchange may take, and any one write.
    pub handshake_timeout: Duration,
    /// Bounds on frames and messages.
    pub limits: Limits,
    /// Liveness checks on 3.1 peers.
    pub heartbeat: Heartbeat,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            limits: Limits::default(),
            heartbeat: Heartbeat::default(),
        }
    }
}

/// An established connection.
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    decoder: Decoder,
    minor: u8,
    options: Options,
    last_heard: Instant,
}

impl Connection {
    /// Connects to `address` (`tcp://host:port`) and completes the handshake as `socket`.
    pub async fn connect(
        address: &str,
        socket: SocketType,
        options: Options,
    ) -> Result<Self, ZmtpError> {
        let target = TcpAddress::parse(address)?;
        let stream = timeout(
            options.connect_timeout,
            TcpStream::connect((target.host.as_str(), target.port)),
        )
        .await
        .map_err(|_| ZmtpError::Timeout {
            what: "connect",
            after: options.connect_timeout,
        })??;
        Self::handshake(stream, socket, options).await
    }

    /// Completes the handshake on an accepted or connected stream.
    pub async fn handshake(
        stream: TcpStream,
        socket: SocketType,
        options: Options,
    ) -> Result<Self, ZmtpError> {
        stream.set_nodelay(true)?;
        let mut conn = Connection {
            stream,
            decoder: Decoder::new(options.limits),
            minor: 0,
            options,
            last_heard: Instant::now(),
        };
        timeout(options.handshake_timeout, conn.exchange_greetings(socket))
            .await
            .map_err(|_| ZmtpError::Timeout {
                what: "ZMTP handshake",
                after: options.handshake_timeout,
            })??;
        Ok(conn)
    }

    async fn exchange_greetings(&mut self, socket: SocketType) -> Result<(), ZmtpError> {
        self.stream.write_all(&wire::greeting()).await?;
        let mut peer = [0u8; GREETING_LEN];
        self.stream
            .read_exact(&mut peer)
            .await
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => ZmtpError::Closed,
                _ => ZmtpError::Io(e),
            })?;
        self.minor = wire::negotiate(&peer)?;
        let ready = encode_ready(&[("Socket-Type", socket.name().as_bytes())]);
        self.stream.write_all(&ready).await?;
        let properties = match self.next_item().await? {
            Item::Command(Command::Ready(properties)) => properties,
            Item::Command(Command::Error(reason)) => {
                return Err(ZmtpError::protocol(format!("peer refused: {reason}")));
            }
            other => {
                return Err(ZmtpError::protocol(format!(
                    "expected READY, got {other:?}"
                )));
            }
        };
        let peer_type = properties
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case("Socket-Type"))
            .map(|(_, value)| value.clone())
            .unwrap_or_default();
        if !socket.accepts(&peer_type) {
            return Err(ZmtpError::protocol(format!(
                "a {} cannot talk to a {:?} socket",
                socket.name(),
                String::from_utf8_lossy(&peer_type)
            )));
        }
        Ok(())
    }

    /// The ZMTP 3 minor version both sides speak (0 or 1).
    pub fn minor_version(&self) -> u8 {
        self.minor
    }

    /// Subscribes to messages whose first frame starts with `topic` (empty: all), in the form
    /// the peer's version expects.
    pub async fn subscribe(&mut self, topic: &[u8]) -> Result<(), ZmtpError> {
        let subscription = encode_subscription(self.minor, topic);
        self.write(&subscription).await
    }

    /// Sends one multipart message.
    pub async fn send(&mut self, frames: &[Bytes]) -> Result<(), ZmtpError> {
        let encoded = encode_message(frames);
        self.write(&encoded).await
    }

    async fn write(&mut self, bytes: &[u8]) -> Result<(), ZmtpError> {
        let after = self.options.handshake_timeout;
        timeout(after, self.stream.write_all(bytes))
            .await
            .map_err(|_| ZmtpError::Timeout {
                what: "write",
                after,
            })??;
        Ok(())
    }

    /// Receives the next message, answering heartbeats on the way. Cancel-safe.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        loop {
            match self.next_item().await? {
                Item::Message(frames) => return Ok(frames),
                Item::Command(Command::Ping { context }) => {
                    let pong = encode_pong(&context);
                    self.write(&pong).await?;
                }
                Item::Command(Command::Error(reason)) => {
                    return Err(ZmtpError::protocol(format!("peer error: {reason}")));
                }
                Item::Command(Command::Ready(_)) => {
                    return Err(ZmtpError::protocol("READY after the handshake"));
                }
                Item::Command(Command::Pong | Command::Other(_)) => {}
            }
        }
    }

    async fn next_item(&mut self) -> Result<Item, ZmtpError> {
        loop {
            if let Some(item) = self.decoder.decode()? {
                return Ok(item);
            }
            let read = if self.minor >= 1 {
                let heartbeat = self.options.heartbeat;
                match timeout(
                    heartbeat.interval,
                    self.stream.read_buf(self.decoder.read_space()),
                )
                .await
                {
                    Ok(read) => read?,
                    Err(_) => {
                        if self.last_heard.elapsed() >= heartbeat.timeout {
                            return Err(ZmtpError::Timeout {
                                what: "heartbeat",
                                after: heartbeat.timeout,
                            });
                        }
                        self.write(&encode_ping()).await?;
                        continue;
                    }
                }
            } else {
                self.stream.read_buf(self.decoder.read_space()).await?
            };
            if read == 0 {
                return Err(ZmtpError::Closed);
            }
            self.last_heard = Instant::now();
        }
    }
}

/// Binds a TCP listener for peers to connect to; returns it with the address it really listens
/// on (the port filled in when `:0` was asked).
pub async fn bind(address: &str) -> Result<(TcpListener, String), ZmtpError> {
    let target = TcpAddress::parse(address)?;
    let listener = TcpListener::bind((target.bind_host(), target.port)).await?;
    let local = listener.local_addr()?;
    Ok((listener, tcp_url(local)))
}
