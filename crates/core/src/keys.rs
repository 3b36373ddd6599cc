//! Block keys: the router's own fast key chain and vLLM's `sha256_cbor` block-hash chain.
//!
//! A prompt is cut into full blocks of `block_size` tokens (a trailing partial block is never
//! cached, so it gets no key). Each block's key depends on its parent's key, its tokens and its
//! extra keys (LoRA adapter name, `cache_salt` on the first block, ...), so equal keys mean equal
//! prefixes. The router key is a 64-bit xxh3 chain, cheap enough to compute on every request;
//! the vLLM chain reproduces the engine's own hashes bit for bit, for checking an engine's
//! configuration and for publishing real hashes from the simulator.

use ciborium_ll::{Encoder, Header, simple};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::CoreError;

/// The router's 64-bit name for a block: a chain over (parent key, tokens, extra keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RouterKey(pub u64);

impl RouterKey {
    /// The key for a 64-bit block hash. Router keys use 63 bits and are never zero, so the
    /// index can keep a flag in the top bit and mark vacant table slots with 0 (a block hash
    /// of 0 becomes key 1; one more collision among 2^63 values).
    pub fn from_hash(hash: u64) -> Self {
        let key = hash & (u64::MAX >> 1);
        RouterKey(if key == 0 { 1 } else { key })
    }
}

/// Parent key of the first block of every chain.
pub const ROOT_KEY: RouterKey = RouterKey(0x6b76_726f_7574_6521);

/// vLLM's default block size (tokens per KV-cache block).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// One element of a block's extra-keys tuple, as vLLM hashes and publishes it.
///
/// vLLM puts the LoRA name, multimodal identifiers and `cache_salt` (first block only) into a
/// tuple hashed with the block; events since 0.17 publish that tuple per block.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ExtraKey {
    /// A signed integer (old `lora_int_id`, multimodal offsets).
    Int(i64),
    /// A text string (LoRA name, cache salt, multimodal identifier).
    Str(String),
    /// A nested tuple (multimodal `(identifier, offset)` pairs).
    List(Vec<ExtraKey>),
    /// Raw bytes (prompt-embedding digests). In JSON they read back as a list of ints.
    Bytes(Vec<u8>),
}

/// The extra keys of one block: `None` when the block has none (vLLM hashes `None`).
pub type BlockExtraKeys = Option<Vec<ExtraKey>>;

/// Extra keys for every block of a request, as vLLM 0.12–0.30 derives them for a plain text
/// prompt (and every version publishes them in its events): the LoRA name on every block, then
/// the cache salt on the first block only.
pub fn request_extra_keys(
    num_blocks: usize,
    lora_name: Option<&str>,
    cache_salt: Option<&str>,
) -> Vec<BlockExtraKeys> {
    per_block_extra_keys(
        num_blocks,
        lora_name.map(|name| ExtraKey::Str(name.to_owned())),
        cache_salt.map(|salt| ExtraKey::Str(salt.to_owned())),
    )
}

/// Extra keys for every block of a request as vLLM 0.31+ hashes them: tagged tuples, `("lora",
/// name, path)` on every block, then `("cache_salt", salt)` on the first block only. Its events
/// still publish the untagged form ([`request_extra_keys`], the name without the path).
pub fn request_extra_keys_tagged(
    num_blocks: usize,
    lora: Option<(&str, &str)>,
    cache_salt: Option<&str>,
) -> Vec<BlockExtraKeys> {
    let tagged = |parts: &[&str]| {
        ExtraKey::List(
            parts
                .iter()
                .map(|p| ExtraKey::Str((*p).to_owned()))
                .collect(),
        )
    };
    per_block_extra_keys(
        num_blocks,
        lora.map(|(name, path)| tagged(&["lora", name, path])),
        cache_salt.map(|salt| tagged(&["cache_salt", salt])),
    )
}

/// `lora` on every one of `num_blocks` blocks, then `salt` on the first block only (vLLM's
/// order: LoRA, then the salt); `None` for a block with neither.
fn per_block_extra_keys(
    num_blocks: usize,
    lora: Option<ExtraKey>,
    salt: Option<ExtraKey>,
) -> Vec<BlockExtraKeys> {
    (0..num_blocks)
        .map(|i| {
            let keys: Vec<ExtraKey> = lora
                .iter()
                .chain(salt.iter().filter(|_| i == 0))
                .cloned()
                .collect();
            (!keys.is_empty()).then_some(keys)
        })
        .collect()
}

fn check_block_size(block_size: usize) -> Result<(), CoreError> {
    if block_size == 0 {
        return Err(CoreError::InvalidBlockSize(block_size));
    }
    Ok(())
}

fn check_extra_len(blocks: usize, extra: Option<&[BlockExtraKeys]>) -> Result<(), CoreError> {
    match extra {
        Some(extra) if extra.len() < blocks => Err(CoreError::ExtraKeysLength {
            blocks,
            extra: extra.len(),
        }),
        _ => Ok(()),
    }
}

/// The router key of one block given its parent's key.
pub fn router_key(parent: RouterKey, tokens: &[u32], extra: Option<&[ExtraKey]>) -> RouterKey {
    // Tokens are hashed as little-endian u32s, then (when present) a 0xff marker and the CBOR
    // of the extra keys, so no token sequence can imitate them. Typical blocks fit a stack
    // buffer and take xxh3's one-shot path, about 3x faster than its streaming state.
    const STACK: usize = 512;
    let extra_cbor = extra.map(|e| cbor_extra_keys(Some(e)));
    let len = tokens.len() * 4 + extra_cbor.as_ref().map_or(0, |c| c.len() + 1);
    if len <= STACK {
        let mut buf = [0u8; STACK];
        for (slot, token) in buf.chunks_exact_mut(4).zip(tokens) {
            slot.copy_from_slice(&token.to_le_bytes());
        }
        if let Some(cbor) = &extra_cbor {
            let at = tokens.len() * 4;
            buf[at] = 0xff;
            buf[at + 1..len].copy_from_slice(cbor);
        }
        return RouterKey::from_hash(xxhash_rust::xxh3::xxh3_64_with_seed(&buf[..len], parent.0));
    }
    let mut hasher = xxhash_rust::xxh3::Xxh3::with_seed(parent.0);
    for token in tokens {
        hasher.update(&token.to_le_bytes());
    }
    if let Some(cbor) = &extra_cbor {
        hasher.update(&[0xff]);
        hasher.update(cbor);
    }
    RouterKey::from_hash(hasher.digest())
}

/// Router keys of every full block of `tokens`, starting a new chain at [`ROOT_KEY`].
///
/// `extra` holds one entry per block (or is `None` when no block has extra keys).
pub fn router_keys(
    tokens: &[u32],
    block_size: usize,
    extra: Option<&[BlockExtraKeys]>,
) -> Result<Vec<RouterKey>, CoreError> {
    router_keys_from(ROOT_KEY, tokens, block_size, extra)
}

/// Router keys of every full block of `tokens`, chained under `parent`.
pub fn router_keys_from(
    parent: RouterKey,
    tokens: &[u32],
    block_size: usize,
    extra: Option<&[BlockExtraKeys]>,
) -> Result<Vec<RouterKey>, CoreError> {
    check_block_size(block_size)?;
    let blocks = tokens.len() / block_size;
    check_extra_len(blocks, extra)?;
    let mut keys = Vec::with_capacity(blocks);
    let mut parent = parent;
    for (i, block) in tokens.chunks_exact(block_size).enumerate() {
        let block_extra = extra.and_then(|e| e[i].as_deref());
        parent = router_key(parent, block, block_extra);
        keys.push(parent);
    }
    Ok(keys)
}

/// A full 32-byte vLLM block digest (`sha256_cbor`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct VllmDigest(pub [u8; 32]);

impl VllmDigest {
    /// The value vLLM publishes in KV events: the last 8 bytes, big-endian.
    pub fn event_u64(&self) -> u64 {
        let mut tail = [0u8; 8];
        tail.copy_from_slice(&self.0[24..]);
        u64::from_be_bytes(tail)
    }

    /// Lower-case hex of the 32 bytes.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// vLLM's `sha256_cbor` block-hash chain for one hash seed.
///
/// NONE_HASH (the first block's parent) is SHA-256 of the CBOR-encoded seed string: vLLM's
/// default seed since 0.29 is `vllm-none-hash`, or the engine's `PYTHONHASHSEED` when set.
#[derive(Clone, Debug)]
pub struct VllmHasher {
    none_hash: VllmDigest,
}

/// vLLM's default NONE_HASH seed string (0.29+).
pub const VLLM_DEFAULT_SEED: &str = "vllm-none-hash";

impl VllmHasher {
    /// A hasher whose NONE_HASH comes from `seed`.
    pub fn new(seed: &str) -> Self {
        let seed_cbor = cbor(|enc| enc.text(seed, None));
        Self {
            none_hash: VllmDigest(Sha256::digest(seed_cbor).into()),
        }
    }

    /// The chain's NONE_HASH.
    pub fn none_hash(&self) -> VllmDigest {
        self.none_hash
    }

    /// The digest of one block given its parent digest (`None` for the first block).
    pub fn block_digest(
        &self,
        parent: Option<&VllmDigest>,
        tokens: &[u32],
        extra: Option<&[ExtraKey]>,
    ) -> VllmDigest {
        let parent = parent.unwrap_or(&self.none_hash);
        let mut bytes = cbor(|enc| {
            enc.push(Header::Array(Some(3)))?;
            enc.bytes(&parent.0, None)?;
            enc.push(Header::Array(Some(tokens.len())))?;
            for &t in tokens {
                enc.push(Header::Positive(u64::from(t)))?;
            }
            Ok(())
        });
        bytes.extend_from_slice(&cbor_extra_keys(extra));
        VllmDigest(Sha256::digest(&bytes).into())
    }

    /// Digests of every full block of `tokens`, in order.
    pub fn block_digests(
        &self,
        tokens: &[u32],
        block_size: usize,
        extra: Option<&[BlockExtraKeys]>,
    ) -> Result<Vec<VllmDigest>, CoreError> {
        check_block_size(block_size)?;
        let blocks = tokens.len() / block_size;
        check_extra_len(blocks, extra)?;
        let mut out: Vec<VllmDigest> = Vec::with_capacity(blocks);
        for (i, block) in tokens.chunks_exact(block_size).enumerate() {
            let block_extra = extra.and_then(|e| e[i].as_deref());
            let digest = self.block_digest(out.last(), block, block_extra);
            out.push(digest);
        }
        Ok(out)
    }
}

/// Canonical CBOR of a block's extra-keys tuple (`null` when absent), as Python's
/// `cbor2.dumps(..., canonical=True)` writes it.
fn cbor_extra_keys(extra: Option<&[ExtraKey]>) -> Vec<u8> {
    cbor(|enc| match extra {
        None => enc.push(Header::Simple(simple::NULL)),
        Some(keys) => write_cbor_list(enc, keys),
    })
}

type CborEncoder<'a> = Encoder<&'a mut Vec<u8>>;

/// Runs `write` against an in-memory CBOR encoder and returns the bytes.
fn cbor(write: impl FnOnce(&mut CborEncoder<'_>) -> Result<(), std::io::Error>) -> Vec<u8> {
    let mut buf = Vec::new();
    write(&mut Encoder::from(&mut buf)).expect("writing CBOR to a Vec cannot fail");
    buf
}

fn write_cbor_list(enc: &mut CborEncoder<'_>, keys: &[ExtraKey]) -> Result<(), std::io::Error> {
    enc.push(Header::Array(Some(keys.len())))?;
    for key in keys {
        match key {
            ExtraKey::Int(v) if *v >= 0 => enc.push(Header::Positive(*v as u64))?,
            // CBOR negative integers carry -1 - v, which is the bitwise complement.
            ExtraKey::Int(v) => enc.push(Header::Negative(!(*v) as u64))?,
            ExtraKey::Str(s) => enc.text(s, None)?,
            ExtraKey::Bytes(b) => enc.bytes(b, None)?,
            ExtraKey::List(inner) => write_cbor_list(enc, inner)?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
