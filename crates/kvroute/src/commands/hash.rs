//! `kvroute hash`: block keys of a token sequence, for checking an engine's hashing.

use std::io::Read;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Args;
use kvroute_core::keys::{
    BlockExtraKeys, VllmHasher, request_extra_keys, request_extra_keys_tagged, router_keys,
};
use serde::Serialize;

/// Arguments of `kvroute hash`.
#[derive(Args)]
pub struct HashArgs {
    /// vLLM's NONE_HASH seed: the engine's PYTHONHASHSEED, or vLLM's default (0.29+).
    #[arg(long, default_value = kvroute_core::keys::VLLM_DEFAULT_SEED)]
    seed: String,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// LoRA adapter name (an extra key on every block).
    #[arg(long, conflicts_with = "extra")]
    lora: Option<String>,
    /// cache_salt (an extra key on the first block).
    #[arg(long, conflicts_with = "extra")]
    cache_salt: Option<String>,
    /// Hash `--lora` and `--cache-salt` as vLLM 0.31+ does: tagged tuples, `("lora", name,
    /// path)` (give `--lora-path`) and `("cache_salt", salt)`. Without it, as 0.12–0.30 does:
    /// the bare name and salt (the form every version's events publish).
    #[arg(long, conflicts_with = "extra")]
    tagged: bool,
    /// The LoRA adapter's path, as the engine loaded it (with `--tagged --lora`).
    #[arg(long, requires = "tagged")]
    lora_path: Option<String>,
    /// Explicit per-block extra keys as JSON, e.g. '[["my-lora","salt"],["my-lora"]]'.
    #[arg(long)]
    extra: Option<String>,
}

#[derive(Serialize)]
struct BlockOut {
    index: usize,
    router_key: String,
    vllm_digest: String,
    vllm_u64: u64,
}

#[derive(Serialize)]
struct HashOut {
    seed: String,
    block_size: usize,
    tokens: usize,
    none_hash: String,
    blocks: Vec<BlockOut>,
}

/// Reads a JSON array of token ids on stdin and prints every full block's keys as JSON.
pub fn run(args: HashArgs) -> anyhow::Result<ExitCode> {
    if args.block_size == 0 {
        bail!("--block-size must be at least 1");
    }
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .context("reading stdin")?;
    let tokens: Vec<u32> = serde_json::from_str(&input)
        .context("stdin must be a JSON array of token ids (non-negative integers below 2^32)")?;
    let blocks = tokens.len() / args.block_size;
    // The router keys a request with its extra keys bare, whatever the release hashes (0.31+
    // events still publish the bare form): `--tagged` changes the digests only.
    let bare = (args.lora.is_some() || args.cache_salt.is_some())
        .then(|| request_extra_keys(blocks, args.lora.as_deref(), args.cache_salt.as_deref()));
    let (router_extra, digest_extra): (Option<Vec<BlockExtraKeys>>, Option<Vec<BlockExtraKeys>>) =
        match &args.extra {
            Some(json) => {
                let mut extra: Vec<BlockExtraKeys> = serde_json::from_str(json).context(
                    "--extra must be a JSON list with one entry (list or null) per block",
                )?;
                if extra.len() < blocks {
                    bail!(
                        "--extra has {} entries but the tokens make {blocks} full blocks",
                        extra.len()
                    );
                }
                extra.truncate(blocks);
                (Some(extra.clone()), Some(extra))
            }
            None if args.tagged => {
                let lora = match (&args.lora, &args.lora_path) {
                    (Some(name), Some(path)) => Some((name.as_str(), path.as_str())),
                    (Some(_), None) => bail!(
                        "--tagged --lora needs --lora-path: vLLM 0.31+ hashes the adapter's path too"
                    ),
                    (None, Some(_)) => bail!("--lora-path needs --lora"),
                    (None, None) => None,
                };
                let tagged = request_extra_keys_tagged(blocks, lora, args.cache_salt.as_deref());
                (bare, Some(tagged))
            }
            None => (bare.clone(), bare),
        };
    let hasher = VllmHasher::new(&args.seed);
    let keys = router_keys(&tokens, args.block_size, router_extra.as_deref())?;
    let digests = hasher.block_digests(&tokens, args.block_size, digest_extra.as_deref())?;
    let out = HashOut {
        seed: args.seed,
        block_size: args.block_size,
        tokens: tokens.len(),
        none_hash: hasher.none_hash().to_hex(),
        blocks: keys
            .iter()
            .zip(&digests)
            .enumerate()
            .map(|(index, (key, digest))| BlockOut {
                index,
                router_key: format!("{:016x}", key.0),
                vllm_digest: digest.to_hex(),
                vllm_u64: digest.event_u64(),
            })
            .collect(),
    };
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(ExitCode::SUCCESS)
}
