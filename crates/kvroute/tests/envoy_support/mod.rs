//! Envoy in front of `kvroute epp`, for the tests that run a gateway: the example
//! configuration with its ports replaced, and the two processes started and waited for.

use std::path::Path;
use std::process::{Command, Stdio};

use kvroute_testkit::{Killed, wait_http};

/// `examples/envoy-epp.yaml` with its three ports replaced.
pub fn envoy_config(listen: u16, epp: u16, admin: u16) -> String {
    let text = include_str!("../../../../examples/envoy-epp.yaml");
    let replaced = text
        .replace("port_value: 8081", &format!("port_value: {listen}"))
        .replace("port_value: 9002", &format!("port_value: {epp}"))
        .replace("port_value: 9901", &format!("port_value: {admin}"))
        .replace("address: 0.0.0.0", "address: 127.0.0.1");
    assert_ne!(replaced, text);
    replaced
}

/// `kvroute epp -c config`, its ext_proc gRPC on `grpc`.
pub fn spawn_epp(config: &Path, grpc: u16) -> Killed {
    let epp = Killed(
        Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["epp", "-c", config.to_str().unwrap()])
            .args(["--grpc-listen", &format!("127.0.0.1:{grpc}")])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_port(grpc);
    epp
}

/// Envoy running `yaml` (written to `dir`), once its listener on `listen` reaches an engine.
pub fn spawn_envoy(envoy: &Path, dir: &Path, yaml: &str, listen: u16) -> Killed {
    let path = dir.join("envoy.yaml");
    std::fs::write(&path, yaml).unwrap();
    let envoy = Killed(
        Command::new(envoy)
            .args(["-c", path.to_str().unwrap()])
            .args(["--concurrency", "1", "--log-level", "warn"])
            .arg("--disable-hot-restart")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // Through Envoy and the picker to an engine's /health: the whole chain is up.
    wait_http(&format!("http://127.0.0.1:{listen}"));
    envoy
}

/// Waits (up to the test patience) until something listens on `port`.
pub fn wait_port(port: u16) {
    let deadline = std::time::Instant::now() + kvroute_testkit::patience();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "port {port} never opened"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
