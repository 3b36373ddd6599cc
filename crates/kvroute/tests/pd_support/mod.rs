//! A client's own `kv_transfer_params`, naming a side channel outside the fleet: what a P/D
//! router must remove before an engine sees it, and a listener on that channel that tells
//! whether an engine connected to it anyway.

use std::net::TcpListener;

use serde_json::{Value, json};

/// A listener a client's `kv_transfer_params` point an engine at.
pub struct ClientParamsTrap {
    listener: TcpListener,
}

impl ClientParamsTrap {
    /// A listener on a free loopback port, never accepting on its own.
    pub fn new() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        Self { listener }
    }

    /// vLLM NixlConnector parameters of a remote prefill held at this listener: an engine that
    /// obeyed them would connect here to pull its KV.
    pub fn params(&self) -> Value {
        json!({
            "do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": "elsewhere", "remote_request_id": "elsewhere-1",
            "remote_block_ids": [1, 2, 3], "remote_registration_generation": 1, "tp_size": 1,
            "transfer_mode": "pull",
            "remote_host": "127.0.0.1", "remote_port": self.listener.local_addr().unwrap().port(),
        })
    }

    /// Fails the test if any connection reached the listener.
    pub fn assert_untouched(&self) {
        assert!(
            matches!(self.listener.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "an engine connected to the address a client named"
        );
    }
}
