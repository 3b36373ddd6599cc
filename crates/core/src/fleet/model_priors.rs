//! What the fleet has measured of each model's requests: the priors an endpoint's own
//! estimates start from until it has measured its own (its block reuse, a decode's length).
//!
//! A fleet may serve several models behind one router (an 8B and a 70B pool, say), whose
//! engines differ by an order of magnitude in decode time and whose caches are reused
//! differently. A prior pooled over all of them would price a new 70B endpoint by what the 8B
//! ones measure, so the priors are kept per group of models: the models some endpoint serves
//! together (a base model and its LoRA adapters, which share its engines, its cache and its
//! decode time) form one group, and a group grows when an endpoint serves models of two groups.
//! The names are the endpoints' (from their specs), so a client naming an unknown model cannot
//! grow the table.

use super::block_reuse::BlockReuse;
use super::pinned;

/// One group's fleet-wide measures.
#[derive(Debug, Default)]
struct Priors {
    /// Blocks its requests found cached and stored, recently.
    reuse: BlockReuse,
    /// Seconds from first token to end, averaged over its requests.
    decode_s: Option<f64>,
}

/// The priors of every group of models some endpoint serves, found by model name.
#[derive(Debug, Default)]
pub(super) struct ModelPriors {
    /// Each model name and its group's slot.
    names: Vec<(String, usize)>,
    /// Each group's measures, by slot. A group merged into another keeps its slot (a request
    /// in flight may still name it), unused from then on.
    groups: Vec<Priors>,
}

impl ModelPriors {
    /// An endpoint serving `models` joined: they share one group from now on.
    pub(super) fn serve(&mut self, models: &[String]) {
        let known: Vec<usize> = models.iter().filter_map(|m| self.slot(m)).collect();
        let target = match known.iter().min() {
            Some(&slot) => slot,
            None => {
                self.groups.push(Priors::default());
                self.groups.len() - 1
            }
        };
        let merged: Vec<usize> = known.into_iter().filter(|&slot| slot != target).collect();
        for (_, slot) in &mut self.names {
            if merged.contains(slot) {
                *slot = target;
            }
        }
        for model in models {
            if self.slot(model).is_none() {
                self.names.push((model.clone(), target));
            }
        }
    }

    /// The slot of `model`'s group, if some endpoint serves it.
    pub(super) fn slot(&self, model: &str) -> Option<usize> {
        // Few models per fleet: a scan beats hashing the name.
        self.names
            .iter()
            .find(|(name, _)| name == model)
            .map(|(_, slot)| *slot)
    }

    /// A request of the group in `slot` found `hits` blocks cached and stored `stored` new
    /// ones at `now`.
    pub(super) fn note_reuse(&mut self, slot: Option<usize>, hits: f64, stored: f64, now: f64) {
        if let Some(p) = slot.and_then(|at| self.groups.get_mut(at)) {
            p.reuse.note(hits, stored, now);
        }
    }

    /// A request of the group in `slot` decoded for `decode_s` seconds.
    pub(super) fn note_decode(&mut self, slot: Option<usize>, decode_s: f64) {
        if let Some(p) = slot.and_then(|at| self.groups.get_mut(at)) {
            p.decode_s = Some(pinned::averaged(p.decode_s, decode_s));
        }
    }

    /// The block reuse an endpoint of the group in `slot` shrinks toward (0 for a group no
    /// request has measured yet).
    pub(super) fn reuse(&self, slot: Option<usize>) -> f64 {
        slot.and_then(|at| self.groups.get(at))
            .map_or(0.0, |p| p.reuse.per_evicted_block())
    }

    /// The decode time of an endpoint of the group in `slot` where none ended yet.
    pub(super) fn decode_s(&self, slot: Option<usize>) -> Option<f64> {
        slot.and_then(|at| self.groups.get(at))
            .and_then(|p| p.decode_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(models: &[&str]) -> Vec<String> {
        models.iter().map(|m| (*m).to_owned()).collect()
    }

    #[test]
    fn each_pool_keeps_its_own_measures() {
        let mut priors = ModelPriors::default();
        priors.serve(&names(&["small"]));
        priors.serve(&names(&["big"]));
        priors.serve(&names(&["small"]));
        let (small, big) = (priors.slot("small"), priors.slot("big"));
        assert_ne!(small, big);
        priors.note_reuse(small, 30.0, 100.0, 0.0);
        priors.note_decode(big, 4.0);
        assert!((priors.reuse(small) - 0.3).abs() < 1e-12);
        assert_eq!(priors.reuse(big), 0.0);
        assert_eq!(priors.decode_s(big), Some(4.0));
        assert_eq!(priors.decode_s(small), None);
    }

    #[test]
    fn an_adapter_shares_its_base_models_measures() {
        let mut priors = ModelPriors::default();
        priors.serve(&names(&["base", "base-sql-lora"]));
        assert_eq!(priors.slot("base"), priors.slot("base-sql-lora"));
        priors.note_decode(priors.slot("base"), 2.0);
        assert_eq!(priors.decode_s(priors.slot("base-sql-lora")), Some(2.0));
    }

    #[test]
    fn an_endpoint_serving_two_groups_joins_them() {
        let mut priors = ModelPriors::default();
        priors.serve(&names(&["a"]));
        priors.serve(&names(&["b"]));
        priors.serve(&names(&["c"]));
        priors.serve(&names(&["b", "a"]));
        assert_eq!(priors.slot("a"), priors.slot("b"));
        assert_ne!(priors.slot("a"), priors.slot("c"));
    }

    #[test]
    fn a_model_no_endpoint_serves_has_no_slot_and_no_prior() {
        let mut priors = ModelPriors::default();
        priors.serve(&names(&["served"]));
        assert_eq!(priors.slot("unknown"), None);
        priors.note_reuse(priors.slot("unknown"), 5.0, 5.0, 0.0);
        priors.note_decode(priors.slot("unknown"), 1.0);
        assert_eq!(priors.reuse(priors.slot("unknown")), 0.0);
        assert_eq!(priors.decode_s(priors.slot("unknown")), None);
        assert_eq!(priors.reuse(priors.slot("served")), 0.0);
        assert_eq!(priors.names.len(), 1);
    }
}
