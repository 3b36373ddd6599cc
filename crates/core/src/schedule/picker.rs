//! Picking the winner among scored candidates.

use serde::{Deserialize, Serialize};

use super::Assessment;

/// How the winner is chosen.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Picker {
    /// Highest total; exact ties broken at random.
    #[default]
    Max,
    /// Sample the winner with probability ∝ exp(total / temperature): spreads load among
    /// near-equal choices, useful when several routers share a fleet.
    Softmax {
        /// Higher: more spread.
        temperature: f64,
    },
    /// Each competing candidate in turn, ignoring scores.
    RoundRobin,
}

/// A deterministic per-candidate shuffle key from the random input.
fn tie_key(random: u64, endpoint: u32) -> u64 {
    let mut x = random ^ (u64::from(endpoint).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x
}

impl Picker {
    /// Indices of `competing` candidates, best first, and a reason when the picker, not the
    /// scores, decided.
    pub(super) fn rank(
        &self,
        assessments: &[Assessment],
        competing: &[usize],
        random: u64,
        round_robin: u64,
    ) -> (Vec<usize>, Option<&'static str>) {
        let mut order = competing.to_vec();
        order.sort_by(|&a, &b| {
            let (x, y) = (&assessments[a], &assessments[b]);
            y.total
                .total_cmp(&x.total)
                .then_with(|| tie_key(random, x.endpoint.0).cmp(&tie_key(random, y.endpoint.0)))
        });
        match self {
            Picker::Max => {
                let tied = order.len() > 1
                    && (assessments[order[0]].total - assessments[order[1]].total).abs() < 1e-12;
                (order, tied.then_some("tie"))
            }
            Picker::RoundRobin => {
                let mut by_id = competing.to_vec();
                by_id.sort_by_key(|&i| assessments[i].endpoint);
                if !by_id.is_empty() {
                    let shift = (round_robin % by_id.len() as u64) as usize;
                    by_id.rotate_left(shift);
                }
                (by_id, Some("round_robin"))
            }
            Picker::Softmax { temperature } => {
                if order.is_empty() {
                    return (order, None);
                }
                let t = temperature.max(1e-6);
                let top = assessments[order[0]].total;
                let weights: Vec<f64> = order
                    .iter()
                    .map(|&i| ((assessments[i].total - top) / t).exp())
                    .collect();
                let sum: f64 = weights.iter().sum();
                let mut target = (random >> 11) as f64 / (1u64 << 53) as f64 * sum;
                let mut pick = order.len() - 1;
                for (k, w) in weights.iter().enumerate() {
                    if target < *w {
                        pick = k;
                        break;
                    }
                    target -= w;
                }
                let chosen = order.remove(pick);
                order.insert(0, chosen);
                (order, Some("softmax"))
            }
        }
    }
}
