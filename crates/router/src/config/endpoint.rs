//! The `endpoints:` section: one engine endpoint, how its engine offloads KV blocks, and how
//! two endpoints may collide.

use std::collections::BTreeMap;

use kvroute_core::index::{OffloadSpec, SharedMount};
use kvroute_core::schedule::Role;
use serde::{Deserialize, Serialize};

use super::invalid;
use crate::RouterError;

/// One engine endpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// A name for logs and metrics (default: the URL's host:port).
    #[serde(default)]
    pub name: Option<String>,
    /// HTTP base URL, e.g. `http://10.0.0.5:8000`.
    pub url: String,
    /// KV-event PUB address (`tcp://10.0.0.5:5557`); without it the endpoint is routed by load
    /// and the router's own history only.
    #[serde(default)]
    pub events: Option<String>,
    /// KV-event replay ROUTER address.
    #[serde(default)]
    pub replay: Option<String>,
    /// KV-event topic (empty: accept all).
    #[serde(default)]
    pub topic: String,
    /// Role for prefill/decode disaggregation.
    #[serde(default)]
    pub role: Role,
    /// Models served (default: every configured model).
    #[serde(default)]
    pub models: Vec<String>,
    /// Free-form labels, shown in explanations.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// How its engine offloads KV blocks below the GPU (CPU, storage, a shared filesystem).
    #[serde(default)]
    pub offload: OffloadConfig,
}

/// Pod label naming the shared KV tier (filesystem) a pod mounts, read by Kubernetes
/// discovery: the same as `offload.shared_mount` in static configuration.
pub const SHARED_MOUNT_LABEL: &str = "kvroute.io/shared-kv-mount";

/// How an endpoint's engine offloads KV blocks below its GPU, as far as its events need it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OffloadConfig {
    /// Tokens per offloaded block: the `block_size` in the OffloadingConnector's
    /// `kv_connector_extra_config` (a multiple of the block size). vLLM 0.20+ publishes one
    /// hash per offloaded block and no size, so a larger one must be given here. Default: one
    /// GPU block.
    #[serde(default)]
    pub block_size: Option<usize>,
    /// Name of the shared filesystem tier the engine mounts; endpoints naming the same mount
    /// share its blocks. Default: the pod label `kvroute.io/shared-kv-mount`, else none.
    #[serde(default)]
    pub shared_mount: Option<String>,
    /// Medium strings of the events that go to the shared mount (compared ignoring case).
    /// Default: `FS` and `OBJ`.
    #[serde(default)]
    pub shared_media: Vec<String>,
}

/// Whether `addr` is `tcp://host:port` with a host and a port of 1–65535 (an address to
/// connect to: no wildcard host).
fn is_tcp_host_port(addr: &str) -> bool {
    addr.strip_prefix("tcp://")
        .and_then(|rest| rest.rsplit_once(':'))
        .is_some_and(|(host, port)| {
            !host.is_empty()
                && host != "*"
                && !host.contains(char::is_whitespace)
                && port.parse::<u16>().is_ok_and(|p| p > 0)
        })
}

/// How two endpoints collide, the gravest first: what configuration validation refuses at
/// start and a joining endpoint is refused for while the router runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum EndpointClash {
    /// One engine (the same host and port): its load and cache picture would split in two.
    Engine,
    /// One KV-event address: one engine's events would feed two endpoints.
    Events,
    /// One name: the two would share metrics and `x-kvroute-endpoint` answers.
    Name,
}

impl EndpointConfig {
    /// What the KV index must know of its offloaded tiers: the configured mount, else the one
    /// its pod label names.
    pub fn offload_spec(&self) -> OffloadSpec {
        let mount = self
            .offload
            .shared_mount
            .clone()
            .or_else(|| self.labels.get(SHARED_MOUNT_LABEL).cloned())
            .filter(|m| !m.is_empty());
        OffloadSpec {
            block_size: self.offload.block_size,
            shared: mount.map(|name| {
                let mut mount = SharedMount::new(name);
                if !self.offload.shared_media.is_empty() {
                    mount.media = self.offload.shared_media.clone();
                }
                mount
            }),
        }
    }

    /// The name the router knows it by in logs, metrics and `x-kvroute-endpoint`: its `name`,
    /// or else `authority`, its URL's `host:port` exactly as written (case and all).
    pub fn name_or_authority<'a>(&'a self, authority: &'a http::uri::Authority) -> &'a str {
        self.name.as_deref().unwrap_or(authority.as_str())
    }

    /// How this endpoint, whose URL has `authority`, collides with `other` (URL authority
    /// `other_authority`), the gravest way: the same engine (the same host and port, host case
    /// ignored: the router sends to the URL's authority alone), the same KV-event address, or
    /// the same name as the router gives them ([`Self::name_or_authority`]). `None` when the
    /// two can serve side by side.
    pub(crate) fn clash_with(
        &self,
        authority: &http::uri::Authority,
        other: &EndpointConfig,
        other_authority: &http::uri::Authority,
    ) -> Option<EndpointClash> {
        if authority
            .as_str()
            .eq_ignore_ascii_case(other_authority.as_str())
        {
            Some(EndpointClash::Engine)
        } else if self.events.is_some() && self.events == other.events {
            Some(EndpointClash::Events)
        } else if self.name_or_authority(authority) == other.name_or_authority(other_authority) {
            Some(EndpointClash::Name)
        } else {
            None
        }
    }

    /// Why this endpoint (URL authority `authority`) cannot join beside one it has `clash` with.
    pub(crate) fn clash_reason(
        &self,
        authority: &http::uri::Authority,
        clash: EndpointClash,
    ) -> String {
        match clash {
            EndpointClash::Engine => format!(
                "{:?} is another endpoint's host and port ({})",
                self.url,
                authority.as_str().to_ascii_lowercase()
            ),
            EndpointClash::Events => {
                format!("{:?} is another endpoint's events address", self.events)
            }
            EndpointClash::Name => format!(
                "{:?} is another endpoint's name",
                self.name_or_authority(authority)
            ),
        }
    }

    /// Checks one endpoint (`field` names it in errors) against the configured model `names`.
    pub fn validate(&self, field: &str, names: &[&str]) -> Result<(), RouterError> {
        let e = self;
        let field = |f: &str| format!("{field}.{f}");
        let url: http::Uri = e
            .url
            .parse()
            .map_err(|err| invalid(&field("url"), format!("{:?} is not a URL: {err}", e.url)))?;
        if url.scheme_str() != Some("http") || url.host().is_none_or(str::is_empty) {
            return Err(invalid(
                &field("url"),
                format!("{:?} must be http://host:port", e.url),
            ));
        }
        let authority = url.authority().map_or("", |a| a.as_str());
        if authority.contains('@') {
            // They would go to the engine in no header and into every error that names it.
            return Err(invalid(
                &field("url"),
                "must not carry credentials (user:password@): put the engine behind no password, or front it with a proxy that adds them",
            ));
        }
        // The port follows the host, and an IPv6 host (`[::1]`) has colons of its own.
        let after_host = authority
            .rsplit_once(']')
            .map_or(authority, |(_, rest)| rest);
        if after_host
            .rsplit_once(':')
            .is_some_and(|(_, port)| port.parse::<u16>().map_or(true, |p| p == 0))
        {
            return Err(invalid(
                &field("url"),
                format!("{:?}: the port must be within 1–65535", e.url),
            ));
        }
        if e.name.as_deref().is_some_and(|n| n.trim().is_empty()) {
            return Err(invalid(&field("name"), "must not be empty"));
        }
        for (f, addr) in [("events", &e.events), ("replay", &e.replay)] {
            if let Some(addr) = addr
                && !is_tcp_host_port(addr)
            {
                return Err(invalid(
                    &field(f),
                    format!("{addr:?} must be tcp://host:port (a port within 1–65535)"),
                ));
            }
        }
        if e.replay.is_some() && e.events.is_none() {
            return Err(invalid(&field("replay"), "needs events as well"));
        }
        for m in &e.models {
            if !names.contains(&m.as_str()) {
                return Err(invalid(
                    &field("models"),
                    format!("{m:?} is not a configured model"),
                ));
            }
        }
        Ok(())
    }
}
