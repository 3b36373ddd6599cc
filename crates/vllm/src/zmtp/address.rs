//! `tcp://host:port` endpoints, as ZMQ writes them (`*` binds every interface, `[::1]` is an
//! IPv6 host).

use super::ZmtpError;

/// A parsed TCP endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpAddress {
    /// Host name or IP literal, without IPv6 brackets; `*` for every interface.
    pub host: String,
    /// Port (0 asks the system for one when binding).
    pub port: u16,
}

impl TcpAddress {
    /// Parses `tcp://host:port`.
    pub fn parse(address: &str) -> Result<Self, ZmtpError> {
        let bad = |reason: &str| ZmtpError::Address {
            address: address.to_owned(),
            reason: reason.to_owned(),
        };
        let rest = address
            .strip_prefix("tcp://")
            .ok_or_else(|| bad("only tcp:// addresses are supported"))?;
        let (host, port) = rest.rsplit_once(':').ok_or_else(|| bad("no port"))?;
        let port = port.parse().map_err(|_| bad("port is not a number"))?;
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        if host.is_empty() {
            return Err(bad("no host"));
        }
        Ok(Self {
            host: host.to_owned(),
            port,
        })
    }

    /// The host to bind: `*` becomes every IPv4 interface.
    pub fn bind_host(&self) -> &str {
        if self.host == "*" {
            "0.0.0.0"
        } else {
            &self.host
        }
    }
}

/// Writes a socket address the way ZMQ does (`tcp://127.0.0.1:5557`, `tcp://[::1]:5557`).
pub fn tcp_url(addr: std::net::SocketAddr) -> String {
    format!("tcp://{addr}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hosts_ports_and_ipv6() {
        let a = TcpAddress::parse("tcp://engine-0.svc:5557").unwrap();
        assert_eq!((a.host.as_str(), a.port), ("engine-0.svc", 5557));
        assert_eq!(TcpAddress::parse("tcp://[::1]:1").unwrap().host, "::1");
        assert_eq!(
            TcpAddress::parse("tcp://*:0").unwrap().bind_host(),
            "0.0.0.0"
        );
        for bad in ["ipc:///tmp/x", "tcp://host", "tcp://:5", "tcp://h:99999"] {
            assert!(TcpAddress::parse(bad).is_err(), "{bad}");
        }
    }
}
