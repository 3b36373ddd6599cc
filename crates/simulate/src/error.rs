//! The one error type of the crate.

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimulateError {
    /// The fleet or run settings are unusable.
    #[error("invalid simulation settings: {0}")]
    Config(String),
    /// The engine model refused its settings.
    #[error(transparent)]
    Engine(#[from] kvroute_sim::SimError),
    /// A policy name that is not known.
    #[error("{0}")]
    Policy(String),
    /// The core refused something (the KV index settings).
    #[error(transparent)]
    Core(#[from] kvroute_core::CoreError),
    /// A file the run writes (its decision log) could not be written.
    #[error("writing {}: {source}", path.display())]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// An engine had work but its step did nothing: the run could never finish.
    #[error("engine {engine} is stalled at t = {at_s:.3} s: it has requests but cannot run them")]
    Stalled {
        /// The engine.
        engine: usize,
        /// Virtual time of the stall, seconds.
        at_s: f64,
    },
}
