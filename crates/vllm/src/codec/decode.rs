//! Decoding a KV-event payload into typed events, whatever the vLLM release.
//!
//! The decoder reads the msgpack stream once, front to back, and builds the typed events as it
//! goes: token ids go straight into `Vec<u32>`, hashes into `Vec<EngineHash>`, and values it does
//! not model (unknown fields and keys, newer envelope elements) are skipped without allocating.
//! Skipped values are still fully checked, so what is accepted is exactly what a generic msgpack
//! parse (`rmpv`, nesting limited to `MAX_DEPTH` as it counts) followed by field conversion
//! would accept. When a payload is refused, the whole payload is checked once more so that the
//! error reports the first problem in that order: not msgpack, then trailing bytes, then what
//! is wrong with the batch.

use kvroute_core::event::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent};
use kvroute_core::keys::{BlockExtraKeys, ExtraKey};
use rmp::Marker;
use rmp::decode as mp;

use super::{REMOVED_FIELDS, STORED_FIELDS};
use crate::VllmError;

/// Nesting deeper than any vLLM payload (batch → events → event → extra keys → tuple) is
/// refused early, so hostile input cannot exhaust the stack. Counted as `rmpv` counts it: every
/// value costs one level, a string, byte string or extension two or three, and an array or
/// map passes two fewer to its elements.
const MAX_DEPTH: u16 = 64;

/// Most elements reserved ahead for one array ([`reserved_for`]): about 32 KiB of extra keys,
/// past any real prompt's per-block arrays but for the longest, which grow as they arrive.
const MAX_RESERVED: usize = 1024;

/// Elements to reserve for an array that declares `len`: no more than the rest of the payload
/// can hold (each element takes at least one byte), nor than [`MAX_RESERVED`], so that hostile
/// lengths nested up to [`MAX_DEPTH`] cannot each reserve the payload's size again (a 1 MiB
/// payload reserved 919 MiB before this bound, a 1 GiB one aborted the process).
fn reserved_for(len: u32, rest: usize) -> usize {
    (len as usize).min(rest).min(MAX_RESERVED)
}

/// A decoded batch plus what the decoder skipped on purpose.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodedBatch {
    /// The batch's events, in order.
    pub batch: EventBatch,
    /// Event type names this decoder does not know (from a newer vLLM), skipped.
    pub unknown_events: Vec<String>,
}

/// Why decoding stopped.
#[derive(Debug)]
enum Fail {
    /// The bytes are not one well-formed msgpack value (truncated, or nested too deeply).
    Msgpack(String),
    /// Well-formed msgpack, but not a batch in any known layout.
    Invalid(String),
}

type Res<T> = std::result::Result<T, Fail>;

fn invalid<T>(msg: impl Into<String>) -> Res<T> {
    Err(Fail::Invalid(msg.into()))
}

/// Maps an `rmp` read error. The decoder peeks at every marker before calling `rmp`, so in
/// practice this is running out of input.
fn msgpack(e: impl std::fmt::Display) -> Fail {
    Fail::Msgpack(e.to_string())
}

/// Decodes one payload (frame 3 of a published message, or of a replayed one).
///
/// A payload that is not a batch in any known layout is an error naming what is wrong; the
/// caller counts and logs it and goes on with the next message. Never panics.
pub fn decode_batch(payload: &[u8]) -> Result<DecodedBatch, VllmError> {
    let mut rd = Reader { rest: payload };
    let fail = match rd.batch() {
        Ok(decoded) if rd.rest.is_empty() => return Ok(decoded),
        Ok(_) => return Err(trailing(rd.rest.len())),
        Err(fail) => fail,
    };
    let msg = match fail {
        Fail::Msgpack(msg) => format!("not msgpack: {msg}"),
        Fail::Invalid(msg) => {
            // The batch stopped at its first bad field; a broken value or trailing bytes further
            // on take precedence, as they describe the payload as a whole.
            let mut check = Reader { rest: payload };
            match check.skip(MAX_DEPTH) {
                Err(Fail::Msgpack(e)) => format!("not msgpack: {e}"),
                Ok(()) if !check.rest.is_empty() => return Err(trailing(check.rest.len())),
                _ => msg,
            }
        }
    };
    Err(VllmError::Decode(msg))
}

fn trailing(n: usize) -> VllmError {
    VllmError::Decode(format!("{n} trailing bytes after the batch"))
}

fn is_nil(m: Marker) -> bool {
    // rmpv reads the reserved marker 0xc1 as nil; so does this decoder.
    matches!(m, Marker::Null | Marker::Reserved)
}

fn is_int(m: Marker) -> bool {
    matches!(
        m,
        Marker::FixPos(_)
            | Marker::FixNeg(_)
            | Marker::U8
            | Marker::U16
            | Marker::U32
            | Marker::U64
            | Marker::I8
            | Marker::I16
            | Marker::I32
            | Marker::I64
    )
}

fn is_str(m: Marker) -> bool {
    matches!(
        m,
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32
    )
}

fn is_bin(m: Marker) -> bool {
    matches!(m, Marker::Bin8 | Marker::Bin16 | Marker::Bin32)
}

fn is_array(m: Marker) -> bool {
    matches!(m, Marker::FixArray(_) | Marker::Array16 | Marker::Array32)
}

fn is_map(m: Marker) -> bool {
    matches!(m, Marker::FixMap(_) | Marker::Map16 | Marker::Map32)
}

fn is_ext(m: Marker) -> bool {
    matches!(
        m,
        Marker::FixExt1
            | Marker::FixExt2
            | Marker::FixExt4
            | Marker::FixExt8
            | Marker::FixExt16
            | Marker::Ext8
            | Marker::Ext16
            | Marker::Ext32
    )
}

/// The msgpack type of a value, as error messages name it.
fn kind(m: Marker) -> &'static str {
    match m {
        _ if is_nil(m) => "nil",
        Marker::True | Marker::False => "bool",
        _ if is_int(m) => "int",
        Marker::F32 | Marker::F64 => "float",
        _ if is_str(m) => "str",
        _ if is_bin(m) => "bytes",
        _ if is_array(m) => "array",
        _ if is_map(m) => "map",
        _ => "ext",
    }
}

/// Checks that a value starting with `m` fits in nesting budget `depth`, which is what `rmpv`
/// allows: one level for any value, two for a byte string, array or map, three for a string or
/// extension. An array's or map's elements get `depth - 2`.
fn check_depth(depth: u16, m: Marker) -> Res<()> {
    let needed = if is_str(m) || is_ext(m) {
        3
    } else if is_bin(m) || is_array(m) || is_map(m) {
        2
    } else {
        1
    };
    if depth < needed {
        return Err(Fail::Msgpack(format!(
            "nested deeper than the limit of {MAX_DEPTH}"
        )));
    }
    Ok(())
}

/// A cursor over the payload. Every reader peeks at the next marker, checks the nesting budget
/// it is given, then reads the value with `rmp`; only token ids and uint64 hashes, the bulk of
/// every payload, have a fast path that reads their bytes directly.
struct Reader<'a> {
    rest: &'a [u8],
}

/// Which fields a map event has given so far: the first occurrence of a key wins, as a lookup
/// in the map would find it.
#[derive(Default)]
struct Seen(u32);

impl Seen {
    /// Marks field `i`; false when it was already marked.
    fn first(&mut self, i: usize) -> bool {
        let bit = 1u32 << i;
        let first = self.0 & bit == 0;
        self.0 |= bit;
        first
    }
}

impl<'a> Reader<'a> {
    fn peek(&self) -> Res<Marker> {
        match self.rest.first() {
            Some(&b) => Ok(Marker::from_u8(b)),
            None => Err(Fail::Msgpack("unexpected end of input".into())),
        }
    }

    /// Peeks at the next value's marker and checks it fits in `depth`.
    fn next(&self, depth: u16) -> Res<Marker> {
        let m = self.peek()?;
        check_depth(depth, m)?;
        Ok(m)
    }

    fn take(&mut self, len: u32) -> Res<&'a [u8]> {
        let (data, rest) = usize::try_from(len)
            .ok()
            .and_then(|len| self.rest.split_at_checked(len))
            .ok_or_else(|| Fail::Msgpack(format!("{len}-byte value runs past the end")))?;
        self.rest = rest;
        Ok(data)
    }

    /// Consumes a one-byte value (nil, bool) already peeked.
    fn bump(&mut self) {
        self.rest = self.rest.get(1..).unwrap_or_default();
    }

    /// An integer of any width (`m`, already peeked, is an int marker).
    #[inline]
    fn int(&mut self, m: Marker) -> Res<Int> {
        let rd = &mut self.rest;
        let int = match m {
            Marker::FixPos(_) => mp::read_pfix(rd).map(|v| Int::Unsigned(v.into())),
            Marker::U8 => mp::read_u8(rd).map(|v| Int::Unsigned(v.into())),
            Marker::U16 => mp::read_u16(rd).map(|v| Int::Unsigned(v.into())),
            Marker::U32 => mp::read_u32(rd).map(|v| Int::Unsigned(v.into())),
            Marker::U64 => mp::read_u64(rd).map(Int::Unsigned),
            Marker::FixNeg(_) => mp::read_nfix(rd).map(|v| Int::Signed(v.into())),
            Marker::I8 => mp::read_i8(rd).map(|v| Int::Signed(v.into())),
            Marker::I16 => mp::read_i16(rd).map(|v| Int::Signed(v.into())),
            Marker::I32 => mp::read_i32(rd).map(|v| Int::Signed(v.into())),
            _ => mp::read_i64(rd).map(Int::Signed),
        };
        int.map_err(msgpack)
    }

    fn array_len(&mut self) -> Res<u32> {
        mp::read_array_len(&mut self.rest).map_err(msgpack)
    }

    fn map_len(&mut self) -> Res<u32> {
        mp::read_map_len(&mut self.rest).map_err(msgpack)
    }

    fn str_bytes(&mut self) -> Res<&'a [u8]> {
        let len = mp::read_str_len(&mut self.rest).map_err(msgpack)?;
        self.take(len)
    }

    fn bin(&mut self) -> Res<&'a [u8]> {
        let len = mp::read_bin_len(&mut self.rest).map_err(msgpack)?;
        self.take(len)
    }

    /// Fast path for token ids: an unsigned int below 2^32 as a fixint, uint8, uint16 or uint32
    /// (what every publisher sends), read without branching on its width; `None` leaves
    /// anything else, and values too close to the end of the input, to the general path.
    #[inline]
    fn fast_u32(&mut self, depth: u16) -> Option<u32> {
        let (&b, tail) = self.rest.split_first()?;
        if depth == 0 {
            return None;
        }
        if b < 0x80 {
            self.rest = tail;
            return Some(b.into());
        }
        // 0xcc, 0xcd, 0xce: 1, 2 or 4 big-endian bytes follow.
        let width = b.wrapping_sub(0xcc);
        let word = tail.first_chunk::<4>()?;
        if width > 2 {
            return None;
        }
        let bytes = 1usize << width;
        self.rest = tail.get(bytes..)?;
        Some(u32::from_be_bytes(*word) >> (32 - 8 * bytes))
    }

    /// Fast path for hashes: a uint64 (how vLLM sends any hash of 2^56 or more).
    #[inline]
    fn fast_u64(&mut self, depth: u16) -> Option<u64> {
        let (&b, tail) = self.rest.split_first()?;
        if b != 0xcf || depth == 0 {
            return None;
        }
        let (word, rest) = tail.split_first_chunk::<8>()?;
        self.rest = rest;
        Some(u64::from_be_bytes(*word))
    }

    /// Skips one value, checking it is well-formed and within `depth`.
    fn skip(&mut self, depth: u16) -> Res<()> {
        let m = self.next(depth)?;
        match m {
            Marker::Null | Marker::Reserved | Marker::True | Marker::False => self.bump(),
            _ if is_int(m) => {
                self.int(m)?;
            }
            Marker::F32 => {
                mp::read_f32(&mut self.rest).map_err(msgpack)?;
            }
            Marker::F64 => {
                mp::read_f64(&mut self.rest).map_err(msgpack)?;
            }
            _ if is_str(m) => {
                self.str_bytes()?;
            }
            _ if is_bin(m) => {
                self.bin()?;
            }
            _ if is_array(m) => {
                for _ in 0..self.array_len()? {
                    self.skip(depth - 2)?;
                }
            }
            _ if is_map(m) => {
                for _ in 0..self.map_len()? {
                    self.skip(depth - 2)?;
                    self.skip(depth - 2)?;
                }
            }
            _ => {
                let meta = mp::read_ext_meta(&mut self.rest).map_err(msgpack)?;
                self.take(meta.size)?;
            }
        }
        Ok(())
    }

    /// Reads a map key: its bytes when it is a string, `None` (and skipped) otherwise.
    fn key(&mut self, depth: u16) -> Res<Option<&'a [u8]>> {
        let m = self.next(depth)?;
        if is_str(m) {
            self.str_bytes().map(Some)
        } else {
            self.skip(depth).map(|()| None)
        }
    }

    /// Consumes a nil (or reserved) value if one comes next.
    fn nil(&mut self, depth: u16) -> Res<bool> {
        let m = self.next(depth)?;
        if is_nil(m) {
            self.bump();
        }
        Ok(is_nil(m))
    }

    fn batch(&mut self) -> Res<DecodedBatch> {
        let depth = MAX_DEPTH;
        let m = self.next(depth)?;
        let inner = depth - 2;
        let (ts, (events, unknown_events), data_parallel_rank) = if is_array(m) {
            let len = self.array_len()?;
            if len < 2 {
                return invalid(format!(
                    "batch array has {len} elements, expected [ts, events, dp_rank?]"
                ));
            }
            let ts = self.ts(inner)?;
            let events = self.events(inner)?;
            let rank = if len > 2 { self.rank(inner)? } else { None };
            for _ in 3..len {
                self.skip(inner)?;
            }
            (ts, events, rank)
        } else if is_map(m) {
            // Unreleased vLLM snapshots encode the envelope as a map.
            let (mut ts, mut events, mut rank) = (None, None, None);
            for _ in 0..self.map_len()? {
                match self.key(inner)? {
                    Some(b"ts") if ts.is_none() => ts = Some(self.ts(inner)?),
                    Some(b"events") if events.is_none() => events = Some(self.events(inner)?),
                    Some(b"data_parallel_rank") if rank.is_none() => {
                        rank = Some(self.rank(inner)?);
                    }
                    _ => self.skip(inner)?,
                }
            }
            let Some(events) = events else {
                return invalid("batch map has no \"events\"");
            };
            (ts.unwrap_or(0.0), events, rank.flatten())
        } else {
            return invalid(format!("batch is a {}, expected an array", kind(m)));
        };
        Ok(DecodedBatch {
            batch: EventBatch {
                ts,
                events,
                data_parallel_rank,
            },
            unknown_events,
        })
    }

    fn ts(&mut self, depth: u16) -> Res<f64> {
        let m = self.next(depth)?;
        match m {
            Marker::F64 => mp::read_f64(&mut self.rest).map_err(msgpack),
            Marker::F32 => mp::read_f32(&mut self.rest).map(f64::from).map_err(msgpack),
            _ if is_int(m) => self.int(m).map(Int::as_f64),
            _ if is_nil(m) => {
                self.bump();
                Ok(0.0)
            }
            _ => invalid(format!("batch ts is a {}, expected a float", kind(m))),
        }
    }

    fn rank(&mut self, depth: u16) -> Res<Option<i64>> {
        if self.nil(depth)? {
            return Ok(None);
        }
        self.i64(depth, "data_parallel_rank").map(Some)
    }

    fn events(&mut self, depth: u16) -> Res<(Vec<KvEvent>, Vec<String>)> {
        let m = self.next(depth)?;
        if !is_array(m) {
            return invalid(format!("batch events is a {}, expected an array", kind(m)));
        }
        let len = self.array_len()?;
        let mut events = Vec::with_capacity((len as usize).min(16));
        let mut unknown = Vec::new();
        for i in 0..len {
            match self.event(depth - 2).map_err(|f| match f {
                Fail::Invalid(msg) => Fail::Invalid(format!("event {i}: {msg}")),
                other => other,
            })? {
                Ok(event) => events.push(event),
                Err(name) => unknown.push(name),
            }
        }
        Ok((events, unknown))
    }

    /// `Ok(event)`, or `Err(type name)` for a type this decoder does not know.
    fn event(&mut self, depth: u16) -> Res<std::result::Result<KvEvent, String>> {
        let m = self.next(depth)?;
        if is_array(m) {
            let len = self.array_len()?;
            if len == 0 || !is_str(self.peek()?) {
                return invalid("positional event does not start with its type name");
            }
            self.next(depth - 2)?;
            let tag = self.str_bytes()?;
            self.positional_event(tag, len - 1, depth - 2)
        } else if is_map(m) {
            let len = self.map_len()?;
            self.map_event(len, depth - 2)
        } else {
            invalid(format!(
                "event is a {}, expected an array or a map",
                kind(m)
            ))
        }
    }

    /// The `fields` elements after a positional event's tag.
    fn positional_event(
        &mut self,
        tag: &[u8],
        fields: u32,
        depth: u16,
    ) -> Res<std::result::Result<KvEvent, String>> {
        let event = match tag {
            b"BlockStored" => {
                let mut e = StoredFields::default();
                for i in 0..fields as usize {
                    self.stored_field(&mut e, i, depth)?;
                }
                KvEvent::BlockStored(e.finish()?)
            }
            b"BlockRemoved" => {
                let mut e = RemovedFields::default();
                for i in 0..fields as usize {
                    self.removed_field(&mut e, i, depth)?;
                }
                KvEvent::BlockRemoved(e.finish()?)
            }
            _ => {
                let event = fieldless(tag)?;
                for _ in 0..fields {
                    self.skip(depth)?;
                }
                return Ok(event);
            }
        };
        Ok(Ok(event))
    }

    /// A map event of `len` entries, its keys and values at `depth`.
    fn map_event(&mut self, len: u32, depth: u16) -> Res<std::result::Result<KvEvent, String>> {
        let body = self.rest;
        // The tag normally comes first (msgspec writes it first), and then the fields are read
        // in the same pass; otherwise the map is read twice, once to find the tag.
        let mut tag = None;
        let mut tag_at = 0;
        for i in 0..len {
            if self.key(depth)? == Some(b"type") {
                let m = self.next(depth)?;
                if !is_str(m) {
                    return invalid(format!("event type is a {}, expected a string", kind(m)));
                }
                tag = Some(self.str_bytes()?);
                tag_at = i;
                break;
            }
            self.skip(depth)?;
        }
        let Some(tag) = tag else {
            return invalid("event map has no \"type\"");
        };
        let entries = if tag_at == 0 {
            len - 1
        } else {
            self.rest = body;
            len
        };
        let event = match tag {
            b"BlockStored" => {
                let mut e = StoredFields::default();
                let mut seen = Seen::default();
                for _ in 0..entries {
                    let key = self.key(depth)?;
                    match key.and_then(|k| STORED_FIELDS.iter().position(|n| n.as_bytes() == k)) {
                        Some(i) if seen.first(i) => self.stored_field(&mut e, i, depth)?,
                        _ => self.skip(depth)?,
                    }
                }
                KvEvent::BlockStored(e.finish()?)
            }
            b"BlockRemoved" => {
                let mut e = RemovedFields::default();
                let mut seen = Seen::default();
                for _ in 0..entries {
                    let key = self.key(depth)?;
                    match key.and_then(|k| REMOVED_FIELDS.iter().position(|n| n.as_bytes() == k)) {
                        Some(i) if seen.first(i) => self.removed_field(&mut e, i, depth)?,
                        _ => self.skip(depth)?,
                    }
                }
                KvEvent::BlockRemoved(e.finish()?)
            }
            _ => {
                let event = fieldless(tag)?;
                for _ in 0..entries {
                    self.skip(depth)?;
                    self.skip(depth)?;
                }
                return Ok(event);
            }
        };
        Ok(Ok(event))
    }

    /// Reads field `i` of `BlockStored` (declaration order, as in [`STORED_FIELDS`]); nil means
    /// absent.
    fn stored_field(&mut self, e: &mut StoredFields, i: usize, depth: u16) -> Res<()> {
        if i > 9 {
            // Fields kvroute does not model (kv_cache_spec_sliding_window, locality, ...).
            return self.skip(depth);
        }
        if self.nil(depth)? {
            return Ok(());
        }
        match i {
            0 => e.block_hashes = Some(self.hashes(depth)?),
            1 => e.parent_block_hash = Some(self.hash(depth, "parent_block_hash")?),
            2 => e.token_ids = self.tokens(depth)?,
            3 => e.block_size = self.u32(depth, "block_size")?,
            4 => e.lora_id = Some(self.i64(depth, "lora_id")?),
            5 => e.medium = Some(self.string(depth, "medium")?),
            6 => e.lora_name = Some(self.string(depth, "lora_name")?),
            7 => e.extra_keys = Some(self.extra_keys(depth)?),
            8 => e.group_idx = Some(self.i64(depth, "group_idx")?),
            _ => e.kv_cache_spec_kind = Some(self.string(depth, "kv_cache_spec_kind")?),
        }
        Ok(())
    }

    /// Reads field `i` of `BlockRemoved` ([`REMOVED_FIELDS`]); nil means absent.
    fn removed_field(&mut self, e: &mut RemovedFields, i: usize, depth: u16) -> Res<()> {
        if i > 2 {
            return self.skip(depth);
        }
        if self.nil(depth)? {
            return Ok(());
        }
        match i {
            0 => e.block_hashes = Some(self.hashes(depth)?),
            1 => e.medium = Some(self.string(depth, "medium")?),
            _ => e.group_idx = Some(self.i64(depth, "group_idx")?),
        }
        Ok(())
    }

    /// An engine hash: an int of any width (signed for old `builtin` hashes) or a digest as
    /// bytes, of which vLLM's int form is the last 8 bytes, big-endian.
    fn hash(&mut self, depth: u16, field: &str) -> Res<EngineHash> {
        let m = self.next(depth)?;
        if is_int(m) {
            return self.int(m).map(|i| EngineHash(i.as_u64()));
        }
        if is_bin(m) {
            let bytes = self.bin()?;
            if !bytes.is_empty() {
                let tail = &bytes[bytes.len().saturating_sub(8)..];
                let mut buf = [0u8; 8];
                buf[8 - tail.len()..].copy_from_slice(tail);
                return Ok(EngineHash(u64::from_be_bytes(buf)));
            }
        }
        invalid(format!(
            "{field}: hash is a {}, expected an int or bytes",
            kind(m)
        ))
    }

    /// `block_hashes`, known not to be nil.
    fn hashes(&mut self, depth: u16) -> Res<Vec<EngineHash>> {
        let m = self.next(depth)?;
        if !is_array(m) {
            return invalid(format!("block_hashes is a {}, expected an array", kind(m)));
        }
        let len = self.array_len()?;
        let mut out = Vec::with_capacity(reserved_for(len, self.rest.len()));
        for _ in 0..len {
            let hash = match self.fast_u64(depth - 2) {
                Some(h) => EngineHash(h),
                None => self.hash(depth - 2, "block_hashes")?,
            };
            out.push(hash);
        }
        Ok(out)
    }

    /// `token_ids`, known not to be nil.
    fn tokens(&mut self, depth: u16) -> Res<Vec<u32>> {
        let m = self.next(depth)?;
        if !is_array(m) {
            return invalid(format!("token_ids is a {}, expected an array", kind(m)));
        }
        let len = self.array_len()?;
        let mut out = Vec::with_capacity(reserved_for(len, self.rest.len()));
        for _ in 0..len {
            let token = match self.fast_u32(depth - 2) {
                Some(t) => t,
                None => self.u32(depth - 2, "token_ids")?,
            };
            out.push(token);
        }
        Ok(out)
    }

    fn i64(&mut self, depth: u16, field: &str) -> Res<i64> {
        let m = self.next(depth)?;
        if !is_int(m) {
            return invalid(format!("{field} is a {}, expected an int", kind(m)));
        }
        match self.int(m)? {
            Int::Signed(i) => Ok(i),
            Int::Unsigned(u) => {
                i64::try_from(u).or_else(|_| invalid(format!("{field}: integer out of range")))
            }
        }
    }

    fn u32(&mut self, depth: u16, field: &str) -> Res<u32> {
        let m = self.next(depth)?;
        if !is_int(m) {
            return invalid(format!(
                "{field} holds a {}, expected an unsigned int",
                kind(m)
            ));
        }
        let i = self.int(m)?;
        let u = match i {
            Int::Unsigned(u) => u32::try_from(u).ok(),
            Int::Signed(s) => u32::try_from(s).ok(),
        };
        u.map_or_else(
            || invalid(format!("{field}: {i} is not a 32-bit unsigned value")),
            Ok,
        )
    }

    fn string(&mut self, depth: u16, field: &str) -> Res<String> {
        let m = self.next(depth)?;
        if !is_str(m) {
            return invalid(format!("{field} is a {}, expected a string", kind(m)));
        }
        match std::str::from_utf8(self.str_bytes()?) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => invalid(format!("{field} is not valid UTF-8")),
        }
    }

    /// `extra_keys`, known not to be nil: one entry per block, nil or a tuple of keys.
    fn extra_keys(&mut self, depth: u16) -> Res<Vec<BlockExtraKeys>> {
        let m = self.next(depth)?;
        if !is_array(m) {
            return invalid(format!("extra_keys is a {}, expected an array", kind(m)));
        }
        let len = self.array_len()?;
        let inner = depth - 2;
        let mut blocks = Vec::with_capacity(reserved_for(len, self.rest.len()));
        for _ in 0..len {
            if self.nil(inner)? {
                blocks.push(None);
                continue;
            }
            let m = self.next(inner)?;
            if !is_array(m) {
                return invalid(format!(
                    "extra_keys entry is a {}, expected an array or nil",
                    kind(m)
                ));
            }
            blocks.push(Some(self.extra_key_list(inner)?));
        }
        Ok(blocks)
    }

    /// The elements of an array (already peeked) of extra keys at `depth`.
    fn extra_key_list(&mut self, depth: u16) -> Res<Vec<ExtraKey>> {
        let len = self.array_len()?;
        let mut keys = Vec::with_capacity(reserved_for(len, self.rest.len()));
        for _ in 0..len {
            keys.push(self.extra_key(depth - 2)?);
        }
        Ok(keys)
    }

    fn extra_key(&mut self, depth: u16) -> Res<ExtraKey> {
        let m = self.next(depth)?;
        if is_int(m) {
            self.i64(depth, "extra key").map(ExtraKey::Int)
        } else if is_str(m) {
            self.string(depth, "extra key").map(ExtraKey::Str)
        } else if is_bin(m) {
            self.bin().map(|b| ExtraKey::Bytes(b.to_vec()))
        } else if is_array(m) {
            self.extra_key_list(depth).map(ExtraKey::List)
        } else {
            invalid(format!(
                "extra key is a {}, expected an int, string, bytes or tuple",
                kind(m)
            ))
        }
    }
}

/// An integer as msgpack carries it: from an unsigned or a signed form (whose value may still be
/// non-negative).
#[derive(Clone, Copy)]
enum Int {
    Unsigned(u64),
    Signed(i64),
}

impl Int {
    /// The low 64 bits: two's complement for negative values, as Python's builtin `hash()`
    /// values are published.
    fn as_u64(self) -> u64 {
        match self {
            Int::Unsigned(u) => u,
            Int::Signed(s) => s as u64,
        }
    }

    /// The nearest float.
    fn as_f64(self) -> f64 {
        match self {
            Int::Unsigned(u) => u as f64,
            Int::Signed(s) => s as f64,
        }
    }
}

impl std::fmt::Display for Int {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Int::Unsigned(u) => u.fmt(f),
            Int::Signed(s) => s.fmt(f),
        }
    }
}

/// An event whose fields the decoder ignores: `AllBlocksCleared`, or `Err(type name)` for a
/// type it does not know.
fn fieldless(tag: &[u8]) -> Res<std::result::Result<KvEvent, String>> {
    if tag == b"AllBlocksCleared" {
        return Ok(Ok(KvEvent::AllBlocksCleared));
    }
    match std::str::from_utf8(tag) {
        Ok(name) => Ok(Err(name.to_owned())),
        Err(_) => invalid("type name is not UTF-8"),
    }
}

/// `BlockStored` fields read so far; `block_hashes` is required.
#[derive(Default)]
struct StoredFields {
    block_hashes: Option<Vec<EngineHash>>,
    parent_block_hash: Option<EngineHash>,
    token_ids: Vec<u32>,
    block_size: u32,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    extra_keys: Option<Vec<BlockExtraKeys>>,
    group_idx: Option<i64>,
    kv_cache_spec_kind: Option<String>,
}

impl StoredFields {
    fn finish(self) -> Res<BlockStored> {
        let Some(block_hashes) = self.block_hashes else {
            return invalid("block_hashes is missing");
        };
        Ok(BlockStored {
            block_hashes,
            parent_block_hash: self.parent_block_hash,
            token_ids: self.token_ids,
            block_size: self.block_size,
            lora_id: self.lora_id,
            medium: self.medium,
            lora_name: self.lora_name,
            extra_keys: self.extra_keys,
            group_idx: self.group_idx,
            kv_cache_spec_kind: self.kv_cache_spec_kind,
        })
    }
}

/// `BlockRemoved` fields read so far.
#[derive(Default)]
struct RemovedFields {
    block_hashes: Option<Vec<EngineHash>>,
    medium: Option<String>,
    group_idx: Option<i64>,
}

impl RemovedFields {
    fn finish(self) -> Res<BlockRemoved> {
        let Some(block_hashes) = self.block_hashes else {
            return invalid("block_hashes is missing");
        };
        Ok(BlockRemoved {
            block_hashes,
            medium: self.medium,
            group_idx: self.group_idx,
        })
    }
}
