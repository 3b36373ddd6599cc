//! What the fleet has measured of each model's requests: the priors an endpoint's own
//! estimates start from until it has measured its own (its block reuse, a decode's length).
//!
//! A fleet may serve several models behind one router (an 8B and a 70B pool, say), whose
//! engines differ by an order of magnitude in prefill rate and decode time and whose caches
//! are reused differently. A prior pooled over all of them would price a new 70B endpoint at
//! what the 8B ones measure, so each model keeps its own. The set of models is the endpoints'
//! (from their specs), so a client naming an unknown model cannot grow it.

use super::endpoint::BlockReuse;
use super::pinned;

/// One model's fleet-wide measures.
#[derive(Debug, Default)]
struct Priors {
    /// Blocks its requests found cached and stored, recently.
    reuse: BlockReuse,
    /// Seconds from first token to end, averaged over its requests.
    decode_s: Option<f64>,
}

/// The priors of every model some endpoint serves, found by name.
#[derive(Debug, Default)]
pub(super) struct ModelPriors {
    models: Vec<(String, Priors)>,
}

impl ModelPriors {
    /// Makes room for `model` (an endpoint that serves it joined); its slot.
    pub(super) fn serve(&mut self, model: &str) -> usize {
        self.slot(model).unwrap_or_else(|| {
            self.models.push((model.to_owned(), Priors::default()));
            self.models.len() - 1
        })
    }

    /// The slot of `model`, if some endpoint serves it.
    pub(super) fn slot(&self, model: &str) -> Option<usize> {
        // Few models per fleet: a scan beats hashing the name.
        self.models.iter().position(|(name, _)| name == model)
    }

    /// A request of the model in `slot` found `hits` blocks cached and stored `stored` new
    /// ones at `now`.
    pub(super) fn note_reuse(&mut self, slot: Option<usize>, hits: f64, stored: f64, now: f64) {
        if let Some((_, p)) = slot.and_then(|at| self.models.get_mut(at)) {
            p.reuse.note(hits, stored, now);
        }
    }

    /// A request of the model in `slot` decoded for `decode_s` seconds.
    pub(super) fn note_decode(&mut self, slot: Option<usize>, decode_s: f64) {
        if let Some((_, p)) = slot.and_then(|at| self.models.get_mut(at)) {
            p.decode_s = Some(pinned::averaged(p.decode_s, decode_s));
        }
    }

    /// The block reuse an endpoint of the model in `slot` shrinks toward (0 for a model no
    /// request has measured yet).
    pub(super) fn reuse(&self, slot: Option<usize>) -> f64 {
        slot.and_then(|at| self.models.get(at))
            .map_or(0.0, |(_, p)| p.reuse.per_evicted_block())
    }

    /// The decode time of an endpoint of the model in `slot` where none ended yet.
    pub(super) fn decode_s(&self, slot: Option<usize>) -> Option<f64> {
        slot.and_then(|at| self.models.get(at))
            .and_then(|(_, p)| p.decode_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_model_keeps_its_own_measures() {
        let mut priors = ModelPriors::default();
        let (small, big) = (priors.serve("small"), priors.serve("big"));
        assert_eq!(priors.serve("small"), small);
        priors.note_reuse(Some(small), 90.0, 10.0, 0.0);
        priors.note_decode(Some(big), 4.0);
        assert_eq!(priors.reuse(Some(small)), 1.0);
        assert_eq!(priors.reuse(Some(big)), 0.0);
        assert_eq!(priors.decode_s(Some(big)), Some(4.0));
        assert_eq!(priors.decode_s(Some(small)), None);
    }

    #[test]
    fn a_model_no_endpoint_serves_has_no_slot_and_no_prior() {
        let mut priors = ModelPriors::default();
        priors.serve("served");
        assert_eq!(priors.slot("unknown"), None);
        priors.note_reuse(None, 5.0, 5.0, 0.0);
        priors.note_decode(None, 1.0);
        assert_eq!(priors.reuse(None), 0.0);
        assert_eq!(priors.decode_s(None), None);
        assert_eq!(priors.models.len(), 1);
    }
}
