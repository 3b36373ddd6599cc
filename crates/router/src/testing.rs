//! What the crate's own integration tests and benchmarks reach inside the router, behind the
//! `test-support` feature (enabled only by the crate's dev-dependency on itself): not part of
//! the public interface, which is the configuration, `server`, `epp` and the error type.
//!
//! Integration tests run a real router over real sockets and need a few handles no user
//! needs: the router state behind a running router (to read its fleet), endpoint membership,
//! the memory budget of docs/operations.md (`memory.rs`, compiled for tests only), a request's
//! preparation (the scheduling benchmark times it) and some timeouts. Re-exporting them here
//! keeps the modules crate-private without moving those tests into the crate.

pub use crate::admin::MODELS_TIMEOUT;
#[cfg(feature = "epp")]
pub use crate::epp::protocol::{
    DESTINATION, EXCHANGE, LB_NAMESPACE, PREFILLER, SUBSET_KEY, SUBSET_NAMESPACE,
};
pub use crate::membership::Membership;
pub use crate::memory::*;
pub use crate::pipeline::prepare_request;
pub use crate::service::Router;
