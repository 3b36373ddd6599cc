//! The frame decoder: bytes in, whole messages and commands out, with every declared length
//! checked against [`Limits`] *before* a byte of its body is buffered.
//!
//! Sans-I/O: the connection reads into [`Decoder::read_space`] and calls [`Decoder::decode`] until
//! it yields an [`Item`]. What the decoder holds is bounded: the frame in progress (at most the
//! limit, since its header was checked first), the frames of the message in progress (at most the
//! limit together), plus one read chunk. Any violation is an error after which the connection
//! must be dropped; the decoder keeps no state worth reusing.

use bytes::{Buf, Bytes, BytesMut};

use super::wire::{Command, FLAG_COMMAND, FLAG_LONG, FLAG_MORE, FLAGS_RESERVED};
use super::{Limits, ZmtpError};

/// Bytes each frame counts against the message limit beyond its body, for the bookkeeping it
/// costs (so a flood of empty frames is bounded as well).
pub const FRAME_OVERHEAD: usize = 32;

/// Most bytes read from the socket in one go.
pub const READ_CHUNK: usize = 64 << 10;

/// Spare room below which the buffer is grown before a read.
const MIN_READ: usize = 4 << 10;

/// What the decoder yields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Item {
    /// A whole multipart message.
    Message(Vec<Bytes>),
    /// A command.
    Command(Command),
}

/// One connection's decoder.
#[derive(Debug)]
pub struct Decoder {
    limits: Limits,
    buffer: BytesMut,
    parts: Vec<Bytes>,
    /// Bytes the message in progress counts against the limit so far.
    message_bytes: usize,
}

/// A checked frame header.
struct Header {
    flags: u8,
    header_len: usize,
    body_len: usize,
}

impl Decoder {
    /// An empty decoder with these limits.
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            buffer: BytesMut::new(),
            parts: Vec::new(),
            message_bytes: 0,
        }
    }

    /// The limits it enforces.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Bytes buffered and not yet decoded (the frame in progress).
    pub fn buffered(&self) -> usize {
        self.buffer.len()
    }

    /// Memory the decoder holds now: its buffer's capacity and the bookkeeping of the message
    /// in progress (the frames already split off it share the buffer's allocations).
    pub fn held_bytes(&self) -> usize {
        self.buffer.capacity() + self.parts.capacity() * std::mem::size_of::<Bytes>()
    }

    /// The buffer to read more bytes into, with room for at most one read chunk (or what the
    /// frame in progress still needs, if less).
    pub fn read_space(&mut self) -> &mut BytesMut {
        let wanted = match self.peek_header() {
            Ok(Some(h)) => (h.header_len + h.body_len)
                .saturating_sub(self.buffer.len())
                .clamp(1, READ_CHUNK),
            Ok(None) => READ_CHUNK.min(self.largest_frame()),
            // The next decode reports the error; there is nothing worth reading.
            Err(_) => 1,
        };
        if self.buffer.capacity() - self.buffer.len() < wanted.min(MIN_READ) {
            self.buffer.reserve(wanted);
        }
        &mut self.buffer
    }

    /// The most bytes one frame may take on the wire, header included.
    fn largest_frame(&self) -> usize {
        self.limits
            .max_message_bytes
            .max(self.limits.max_command_bytes)
            .saturating_add(9)
    }

    /// Decodes the next message or command if the buffer holds all of it; `Ok(None)` asks for
    /// more bytes. An error means the peer broke the protocol or the limits.
    pub fn decode(&mut self) -> Result<Option<Item>, ZmtpError> {
        loop {
            let Some(header) = self.peek_header()? else {
                return Ok(None);
            };
            if self.buffer.len() < header.header_len + header.body_len {
                return Ok(None);
            }
            self.buffer.advance(header.header_len);
            let body = self.buffer.split_to(header.body_len).freeze();
            if header.flags & FLAG_COMMAND != 0 {
                return Command::parse(&body).map(|c| Some(Item::Command(c)));
            }
            self.message_bytes += header.body_len + FRAME_OVERHEAD;
            self.parts.push(body);
            if header.flags & FLAG_MORE == 0 {
                self.message_bytes = 0;
                return Ok(Some(Item::Message(std::mem::take(&mut self.parts))));
            }
        }
    }

    /// Reads and checks the next frame's header without consuming it; `Ok(None)` if it is not
    /// all buffered yet.
    fn peek_header(&self) -> Result<Option<Header>, ZmtpError> {
        let Some(&flags) = self.buffer.first() else {
            return Ok(None);
        };
        if flags & FLAGS_RESERVED != 0 {
            return Err(ZmtpError::protocol(format!(
                "frame flags {flags:#04x} set reserved bits"
            )));
        }
        let header_len = if flags & FLAG_LONG != 0 { 9 } else { 2 };
        if self.buffer.len() < header_len {
            return Ok(None);
        }
        let declared = if header_len == 9 {
            u64::from_be_bytes(self.buffer[1..9].try_into().expect("8 bytes"))
        } else {
            u64::from(self.buffer[1])
        };
        let body_len = if flags & FLAG_COMMAND != 0 {
            self.check_command(flags, declared)?
        } else {
            self.check_frame(declared)?
        };
        Ok(Some(Header {
            flags,
            header_len,
            body_len,
        }))
    }

    fn check_command(&self, flags: u8, declared: u64) -> Result<usize, ZmtpError> {
        if flags & FLAG_MORE != 0 {
            return Err(ZmtpError::protocol("a command frame cannot have MORE set"));
        }
        if !self.parts.is_empty() {
            return Err(ZmtpError::protocol("a command inside a multipart message"));
        }
        if declared > self.limits.max_command_bytes as u64 {
            return Err(ZmtpError::TooLarge {
                what: "command",
                declared,
                limit: self.limits.max_command_bytes,
            });
        }
        Ok(declared as usize)
    }

    fn check_frame(&self, declared: u64) -> Result<usize, ZmtpError> {
        let limit = self.limits.max_message_bytes;
        if declared > limit as u64 {
            return Err(ZmtpError::TooLarge {
                what: "frame",
                declared,
                limit,
            });
        }
        let total = (self.message_bytes + FRAME_OVERHEAD) as u64 + declared;
        if total > limit as u64 {
            return Err(ZmtpError::TooLarge {
                what: "message",
                declared: total,
                limit,
            });
        }
        Ok(declared as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zmtp::wire::{encode_message, encode_ready};

    fn small() -> Decoder {
        Decoder::new(Limits {
            max_message_bytes: 1000,
            max_command_bytes: 100,
        })
    }

    fn feed(d: &mut Decoder, bytes: &[u8]) -> Result<Vec<Item>, ZmtpError> {
        let mut items = Vec::new();
        for chunk in bytes.chunks(7) {
            d.read_space().extend_from_slice(chunk);
            while let Some(item) = d.decode()? {
                items.push(item);
            }
        }
        Ok(items)
    }

    #[test]
    fn messages_and_commands_come_out_whole_from_any_chunking() {
        let mut d = small();
        let frames = vec![
            Bytes::from_static(b"topic"),
            Bytes::from(vec![9u8; 300]),
            Bytes::new(),
        ];
        let mut wire = encode_ready(&[("Socket-Type", b"PUB")]).to_vec();
        wire.extend_from_slice(&encode_message(&frames));
        wire.extend_from_slice(&encode_message(&frames));
        let items = feed(&mut d, &wire).unwrap();
        assert_eq!(items.len(), 3);
        assert!(matches!(items[0], Item::Command(Command::Ready(_))));
        assert_eq!(items[1], Item::Message(frames.clone()));
        assert_eq!(items[2], Item::Message(frames));
        assert_eq!(d.buffered(), 0);
    }

    #[test]
    fn a_huge_declared_frame_is_refused_from_its_header_alone() {
        let mut d = small();
        let mut header = vec![FLAG_LONG];
        header.extend_from_slice(&(1u64 << 62).to_be_bytes());
        let err = feed(&mut d, &header).unwrap_err();
        assert!(err.is_too_large(), "{err}");
        assert!(d.buffer.capacity() <= READ_CHUNK, "{}", d.buffer.capacity());
    }

    #[test]
    fn frames_summing_over_the_limit_are_refused() {
        let mut d = small();
        let frames: Vec<Bytes> = (0..5).map(|_| Bytes::from(vec![1u8; 200])).collect();
        let err = feed(&mut d, &encode_message(&frames)).unwrap_err();
        assert!(
            matches!(
                err,
                ZmtpError::TooLarge {
                    what: "message",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_flood_of_empty_frames_is_bounded_by_their_overhead() {
        let mut d = small();
        let wire: Vec<u8> = std::iter::repeat_n([FLAG_MORE, 0], 100).flatten().collect();
        let err = feed(&mut d, &wire).unwrap_err();
        assert!(err.is_too_large(), "{err}");
        assert!(d.parts.len() <= 1000 / FRAME_OVERHEAD);
    }

    #[test]
    fn reserved_flags_and_commands_inside_messages_are_protocol_errors() {
        assert!(feed(&mut small(), &[0x08, 0]).is_err());
        assert!(feed(&mut small(), &[FLAG_MORE, 1, b'a', FLAG_COMMAND, 1, 0]).is_err());
        assert!(feed(&mut small(), &[FLAG_COMMAND | FLAG_MORE, 1, 0]).is_err());
        let over = [FLAG_COMMAND, 101];
        assert!(feed(&mut small(), &over).unwrap_err().is_too_large());
    }
}
