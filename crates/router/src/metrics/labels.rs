//! The typed label sets of the router's metric families. The `endpoint` label is not among
//! them: [`super::ByEndpoint`] adds it in front (or leaves it out, with per-endpoint series off).

use prometheus_client::encoding::{EncodeLabelSet, LabelSetEncoder};

/// No label besides the endpoint's.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct NoLabels;

impl EncodeLabelSet for NoLabels {
    fn encode(&self, _encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        Ok(())
    }
}

/// The `status` label: the HTTP status a refusal was answered with.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabel {
    /// The HTTP status code.
    pub status: u16,
}

/// The `kind` label: which kind of problem or timeout.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// The kind, e.g. `header`, `body`, `port_out_of_range`.
    pub kind: &'static str,
}

/// The `reason` label: why a request was shed or retried, or a stream cut.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// The reason, e.g. `queue_full`, `stalled`, `connect`.
    pub reason: &'static str,
}

/// The `listener` label: which client listener (`api`, `admin`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabel {
    /// The listener's name.
    pub listener: &'static str,
}

/// The `outcome` label: how a prediction compared with what the engine reported.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `exact`, `over` or `under`.
    pub outcome: &'static str,
}

/// The `tier` label: where cached blocks live.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TierLabel {
    /// The tier's name (`gpu`, `cpu`, `storage`).
    pub tier: String,
}

/// The labels of a routed request (after the endpoint's), in this order.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// Why the endpoint was chosen (the decision's reason).
    pub reason: &'static str,
    /// The status class, e.g. `2xx`.
    pub status: String,
    /// How the request ended (`completed`, `client_closed`, ...).
    pub outcome: &'static str,
}
