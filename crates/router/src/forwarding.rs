//! Which request and response headers a proxied request carries, after RFC 9110 §7.6.1: the
//! hop-by-hop headers, and every header the `Connection` header names, stop at the router;
//! `X-Forwarded-For` and `Forwarded` get the client's address appended, and what a client sent
//! in them is kept only when the client is a trusted proxy (`forwarding.trusted_proxies`),
//! since anyone else could forge them.

use std::net::{IpAddr, SocketAddr};

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};

/// The client's address, which the edge puts in every request's extensions.
#[derive(Clone, Copy, Debug)]
pub struct ClientAddr(pub SocketAddr);

/// The forwarding section of the configuration.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ForwardingConfig {
    /// Addresses or networks (`10.0.0.0/8`, `::1`) of the proxies in front of the router
    /// whose `X-Forwarded-For` and `Forwarded` headers are kept (the client's address is
    /// appended to them). From any other client they are replaced by its address alone.
    pub trusted_proxies: Vec<Network>,
    /// Ask the engine for usage on a streamed request that names no `stream_options`
    /// (`"stream_options":{"include_usage":true}` added to its body) and take the usage event
    /// out of the stream again before the client sees it: the router then learns from every
    /// stream (prediction error, prefill rates, output lengths), not only from those whose
    /// client asked for usage.
    pub stream_usage: bool,
}

impl Default for ForwardingConfig {
    fn default() -> Self {
        Self {
            trusted_proxies: Vec::new(),
            stream_usage: true,
        }
    }
}

impl ForwardingConfig {
    /// Whether `peer` is a trusted proxy.
    pub fn trusts(&self, peer: IpAddr) -> bool {
        self.trusted_proxies.iter().any(|n| n.contains(peer))
    }
}

/// An IP network, written `address` or `address/prefix`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Network {
    address: IpAddr,
    prefix: u8,
}

impl TryFrom<String> for Network {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        let (address, prefix) = match text.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text.as_str(), None),
        };
        let address: IpAddr = address
            .parse()
            .map_err(|_| format!("{text:?} is not an IP address or network"))?;
        let bits = if address.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|&p| p <= bits)
                .ok_or_else(|| format!("{text:?}: the prefix must be 0–{bits}"))?,
            None => bits,
        };
        Ok(Self { address, prefix })
    }
}

impl From<Network> for String {
    fn from(n: Network) -> String {
        format!("{}/{}", n.address, n.prefix)
    }
}

impl Network {
    /// Whether `ip` is in this network (an IPv4-mapped IPv6 address counts as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        let (a, b, bits) = match (self.address, ip) {
            (IpAddr::V4(a), IpAddr::V4(b)) => {
                (u128::from(a.to_bits()), u128::from(b.to_bits()), 32)
            }
            (IpAddr::V6(a), IpAddr::V6(b)) => (a.to_bits(), b.to_bits(), 128),
            _ => return false,
        };
        let shift = bits - u32::from(self.prefix);
        shift >= bits || (a >> shift) == (b >> shift)
    }
}

/// Hop-by-hop headers (RFC 9110 §7.6.1 and the connection-specific ones of RFC 9113 §8.2.2),
/// plus those the router sets itself (`host`, `content-length`).
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "upgrade"
            | "te"
            | "trailer"
            | "http2-settings"
            | "host"
            | "content-length"
    )
}

/// The headers the `Connection` header names (each one hop-by-hop for this message).
fn named_by_connection(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|token| token.trim().to_ascii_lowercase())
        .filter(|token| !token.is_empty())
        .collect()
}

/// The end-to-end headers of `headers`, less those named in `skip`: what a proxy passes on.
pub fn end_to_end<'a>(
    headers: &'a HeaderMap,
    skip: &'a [&str],
) -> impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)> + 'a {
    let connection = named_by_connection(headers);
    headers.iter().filter(move |(name, _)| {
        !hop_by_hop(name)
            && !skip.contains(&name.as_str())
            && !connection.iter().any(|c| c == name.as_str())
    })
}

/// The headers a client's request is forwarded with, besides its end-to-end ones: its
/// `X-Forwarded-For` and `Forwarded` with `client` appended (kept from the request only when
/// `client` is a trusted proxy). The request's own are among the `skip` names of
/// [`end_to_end`]: [`FORWARDING_HEADERS`].
pub fn forwarded_for(
    config: &ForwardingConfig,
    request: &HeaderMap,
    client: Option<SocketAddr>,
) -> Vec<(HeaderName, HeaderValue)> {
    let Some(client) = client else {
        return Vec::new();
    };
    let trusted = config.trusts(client.ip());
    let joined = |name: HeaderName| -> Vec<String> {
        if !trusted {
            return Vec::new();
        }
        request
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .map(str::to_owned)
            .collect()
    };
    let ip = client.ip();
    let mut xff = joined(HeaderName::from_static("x-forwarded-for"));
    xff.push(ip.to_string());
    let mut forwarded = joined(header::FORWARDED);
    forwarded.push(match ip {
        IpAddr::V4(v4) => format!("for={v4}"),
        IpAddr::V6(v6) => format!("for=\"[{v6}]\""),
    });
    [
        (HeaderName::from_static("x-forwarded-for"), xff.join(", ")),
        (header::FORWARDED, forwarded.join(", ")),
    ]
    .into_iter()
    .filter_map(|(name, value)| Some((name, HeaderValue::from_str(&value).ok()?)))
    .collect()
}

/// Request headers [`forwarded_for`] rewrites, and the request id the router sets itself.
pub const FORWARDING_HEADERS: [&str; 3] = ["x-forwarded-for", "forwarded", "x-request-id"];

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Network {
        Network::try_from(s.to_owned()).unwrap()
    }

    #[test]
    fn networks_contain_their_addresses() {
        assert!(net("10.0.0.0/8").contains("10.1.2.3".parse().unwrap()));
        assert!(!net("10.0.0.0/8").contains("11.0.0.1".parse().unwrap()));
        assert!(net("127.0.0.1").contains("::ffff:127.0.0.1".parse().unwrap()));
        assert!(net("0.0.0.0/0").contains("192.0.2.1".parse().unwrap()));
        assert!(net("fd00::/8").contains("fd12::1".parse().unwrap()));
        assert!(!net("fd00::/8").contains("10.0.0.1".parse().unwrap()));
        for bad in ["10.0.0.0/33", "nowhere", "::1/129"] {
            assert!(Network::try_from(bad.to_owned()).is_err(), "{bad}");
        }
    }

    #[test]
    fn headers_named_by_connection_stop_at_the_router() {
        let mut h = HeaderMap::new();
        h.insert("connection", "keep-alive, X-Secret".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("http2-settings", "AAA".parse().unwrap());
        h.insert("x-kept", "1".parse().unwrap());
        let kept: Vec<&str> = end_to_end(&h, &[]).map(|(n, _)| n.as_str()).collect();
        assert_eq!(kept, ["x-kept"]);
    }

    #[test]
    fn forwarded_headers_are_kept_only_from_trusted_proxies() {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", "203.0.113.9".parse().unwrap());
        h.insert("forwarded", "for=203.0.113.9".parse().unwrap());
        let trusting = ForwardingConfig {
            trusted_proxies: vec![net("10.0.0.0/8")],
            ..ForwardingConfig::default()
        };
        let value = |headers: &[(HeaderName, HeaderValue)], name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.to_str().unwrap().to_owned())
                .unwrap()
        };
        let proxy = Some("10.0.0.7:5000".parse().unwrap());
        let out = forwarded_for(&trusting, &h, proxy);
        assert_eq!(value(&out, "x-forwarded-for"), "203.0.113.9, 10.0.0.7");
        assert_eq!(value(&out, "forwarded"), "for=203.0.113.9, for=10.0.0.7");
        let stranger = Some("[2001:db8::1]:5000".parse().unwrap());
        let out = forwarded_for(&trusting, &h, stranger);
        assert_eq!(value(&out, "x-forwarded-for"), "2001:db8::1");
        assert_eq!(value(&out, "forwarded"), "for=\"[2001:db8::1]\"");
    }
}
