//! ZMTP 3.x on the wire (RFC 23 and 37): the 64-byte greeting, frame headers, and the commands
//! kvroute sends and understands. Pure functions over bytes; no I/O.

use bytes::{BufMut, Bytes, BytesMut};

use super::ZmtpError;

/// Length of the greeting each side sends first.
pub const GREETING_LEN: usize = 64;

/// Flag bit: more frames of this message follow.
pub const FLAG_MORE: u8 = 0x01;
/// Flag bit: the size is 8 bytes (else 1).
pub const FLAG_LONG: u8 = 0x02;
/// Flag bit: the frame is a command.
pub const FLAG_COMMAND: u8 = 0x04;
/// Bits a ZMTP 3 frame header must leave clear.
pub const FLAGS_RESERVED: u8 = 0xF8;

/// The minor version kvroute announces: 3.1 (SUBSCRIBE/CANCEL and PING/PONG commands).
pub const OUR_MINOR: u8 = 1;

const MECHANISM_NULL: &[u8] = b"NULL";

/// kvroute's greeting: ZMTP 3.1, the NULL mechanism, as client.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[8] = 0x01;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = OUR_MINOR;
    g[12..12 + MECHANISM_NULL.len()].copy_from_slice(MECHANISM_NULL);
    g
}

/// Checks a peer's greeting and returns the minor version both sides speak (3.0 or 3.1).
pub fn negotiate(peer: &[u8; GREETING_LEN]) -> Result<u8, ZmtpError> {
    if peer[0] != 0xFF || peer[9] & 0x01 != 0x01 {
        return Err(ZmtpError::protocol("not a ZMTP greeting"));
    }
    let (major, minor) = (peer[10], peer[11]);
    if major < 3 {
        return Err(ZmtpError::protocol(format!(
            "peer speaks ZMTP {major}.{minor}; kvroute needs 3.x (libzmq 4 or later)"
        )));
    }
    let mechanism = &peer[12..32];
    let name_len = mechanism.iter().position(|b| *b == 0).unwrap_or(20);
    if &mechanism[..name_len] != MECHANISM_NULL || mechanism[name_len..].iter().any(|b| *b != 0) {
        return Err(ZmtpError::protocol(format!(
            "peer wants security mechanism {:?}; kvroute speaks only NULL",
            String::from_utf8_lossy(&mechanism[..name_len])
        )));
    }
    Ok(if major > 3 {
        OUR_MINOR
    } else {
        minor.min(OUR_MINOR)
    })
}

/// Appends a frame header for a body of `len` bytes with the given flags (MORE, COMMAND).
pub fn put_header(out: &mut BytesMut, flags: u8, len: usize) {
    if len > usize::from(u8::MAX) {
        out.put_u8(flags | FLAG_LONG);
        out.put_u64(len as u64);
    } else {
        out.put_u8(flags);
        out.put_u8(len as u8);
    }
}

/// Encodes a multipart message.
pub fn encode_message(frames: &[Bytes]) -> BytesMut {
    let total: usize = frames.iter().map(|f| f.len() + 9).sum();
    let mut out = BytesMut::with_capacity(total);
    for (i, frame) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
        put_header(&mut out, more, frame.len());
        out.put_slice(frame);
    }
    if frames.is_empty() {
        put_header(&mut out, 0, 0);
    }
    out
}

/// Encodes a command: its name, then its data.
pub fn encode_command(name: &str, data: &[u8]) -> BytesMut {
    let mut out = BytesMut::with_capacity(name.len() + data.len() + 10);
    put_header(&mut out, FLAG_COMMAND, 1 + name.len() + data.len());
    out.put_u8(name.len() as u8);
    out.put_slice(name.as_bytes());
    out.put_slice(data);
    out
}

/// Encodes READY with the given properties (`Socket-Type`, `Identity`, ...).
pub fn encode_ready(properties: &[(&str, &[u8])]) -> BytesMut {
    let mut data = BytesMut::new();
    for (name, value) in properties {
        data.put_u8(name.len() as u8);
        data.put_slice(name.as_bytes());
        data.put_u32(value.len() as u32);
        data.put_slice(value);
    }
    encode_command("READY", &data)
}

/// A subscription in the form the negotiated version expects: a SUBSCRIBE command in 3.1, a
/// message `\x01topic` in 3.0.
pub fn encode_subscription(minor: u8, topic: &[u8]) -> BytesMut {
    if minor >= 1 {
        encode_command("SUBSCRIBE", topic)
    } else {
        let mut body = Vec::with_capacity(topic.len() + 1);
        body.push(1);
        body.extend_from_slice(topic);
        encode_message(&[Bytes::from(body)])
    }
}

/// A command received from the peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// The peer's metadata after the greeting.
    Ready(Vec<(String, Bytes)>),
    /// A heartbeat to answer with PONG and the context.
    Ping {
        /// What PONG must echo.
        context: Bytes,
    },
    /// The answer to our PING.
    Pong,
    /// The peer refuses the connection, with its reason.
    Error(String),
    /// Any other command (SUBSCRIBE to a SUB, or a future one): ignored.
    Other(String),
}

impl Command {
    /// Parses a command frame's body.
    pub fn parse(body: &Bytes) -> Result<Command, ZmtpError> {
        let (&name_len, rest) = body
            .split_first()
            .ok_or_else(|| ZmtpError::protocol("empty command"))?;
        let name_len = usize::from(name_len);
        if rest.len() < name_len {
            return Err(ZmtpError::protocol("command name overruns its frame"));
        }
        let name = String::from_utf8_lossy(&rest[..name_len]).into_owned();
        let data = body.slice(1 + name_len..);
        Ok(match name.as_str() {
            "READY" => Command::Ready(parse_properties(&data)?),
            "PING" => {
                if data.len() < 2 {
                    return Err(ZmtpError::protocol("PING without its TTL"));
                }
                let context = data.slice(2..);
                if context.len() > 16 {
                    return Err(ZmtpError::protocol("PING context over 16 bytes"));
                }
                Command::Ping { context }
            }
            "PONG" => Command::Pong,
            "ERROR" => {
                let reason = data
                    .split_first()
                    .map(|(len, rest)| &rest[..usize::from(*len).min(rest.len())])
                    .unwrap_or_default();
                Command::Error(String::from_utf8_lossy(reason).into_owned())
            }
            _ => Command::Other(name),
        })
    }
}

fn parse_properties(mut data: &[u8]) -> Result<Vec<(String, Bytes)>, ZmtpError> {
    let bad = || ZmtpError::protocol("malformed READY properties");
    let mut properties = Vec::new();
    while let Some((&name_len, rest)) = data.split_first() {
        let name_len = usize::from(name_len);
        let name = rest.get(..name_len).ok_or_else(bad)?;
        let rest = &rest[name_len..];
        let len_bytes: [u8; 4] = rest
            .get(..4)
            .ok_or_else(bad)?
            .try_into()
            .map_err(|_| bad())?;
        let value_len = u32::from_be_bytes(len_bytes) as usize;
        let value = rest
            .get(4..4usize.saturating_add(value_len))
            .ok_or_else(bad)?;
        properties.push((
            String::from_utf8_lossy(name).into_owned(),
            Bytes::copy_from_slice(value),
        ));
        data = &rest[4 + value_len..];
    }
    Ok(properties)
}

/// The PONG answering a PING's context.
pub fn encode_pong(context: &[u8]) -> BytesMut {
    encode_command("PONG", context)
}

/// A PING with no TTL (the peer must not time us out on it) and no context.
pub fn encode_ping() -> BytesMut {
    encode_command("PING", &[0, 0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_3_0_peer_gets_a_subscription_message_and_a_3_1_peer_a_command() {
        let mut peer = greeting();
        peer[11] = 0;
        assert_eq!(negotiate(&peer).unwrap(), 0);
        assert_eq!(&encode_subscription(0, b"kv")[..], b"\x00\x03\x01kv");
        peer[11] = 1;
        assert_eq!(negotiate(&peer).unwrap(), 1);
        assert_eq!(
            &encode_subscription(1, b"kv")[..],
            b"\x04\x0c\x09SUBSCRIBEkv"
        );
    }

    #[test]
    fn greetings_of_other_protocols_and_mechanisms_are_refused() {
        let mut old = greeting();
        old[10] = 2;
        assert!(negotiate(&old).is_err());
        let mut curve = greeting();
        curve[12..17].copy_from_slice(b"CURVE");
        assert!(negotiate(&curve).is_err());
        assert!(negotiate(&[0u8; GREETING_LEN]).is_err());
    }

    #[test]
    fn ready_properties_round_trip_and_overruns_are_errors() {
        let ready = encode_ready(&[("Socket-Type", b"SUB"), ("Identity", b"")]);
        let body = Bytes::copy_from_slice(&ready[2..]);
        assert_eq!(
            Command::parse(&body).unwrap(),
            Command::Ready(vec![
                ("Socket-Type".into(), Bytes::from_static(b"SUB")),
                ("Identity".into(), Bytes::new()),
            ])
        );
        let truncated = Bytes::copy_from_slice(&ready[2..ready.len() - 1]);
        assert!(Command::parse(&truncated).is_err());
        let huge_value = Bytes::from_static(b"\x05READY\x01a\xff\xff\xff\xffxyz");
        assert!(Command::parse(&huge_value).is_err());
    }

    #[test]
    fn long_frames_use_the_eight_byte_size() {
        let frame = Bytes::from(vec![7u8; 300]);
        let encoded = encode_message(&[frame]);
        assert_eq!(encoded[0], FLAG_LONG);
        assert_eq!(&encoded[1..9], &300u64.to_be_bytes());
        assert_eq!(encoded.len(), 309);
    }
}
