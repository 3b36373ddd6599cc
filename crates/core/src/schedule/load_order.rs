//! The fleet's endpoints kept in order of a lower bound of their cost while they hold nothing
//! of a prompt, updated as their load and prefill rate change: the stream a pruned plan
//! ([`super::schedule_pruned`]) walks for the endpoints that hold none of the prompt the cost
//! counts ([`super::cost::countable_blocks`]), least busy first, with one order per (model,
//! block size) served and the members a plan may see unsaturated.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::{Profile, cost};
use crate::index::EndpointId;

/// Seconds before a load sample's expiry at which its endpoint's bound stops counting it: far
/// more than the rounding of `at + max_age` against `now - at`.
const EXPIRY_SLACK_S: f64 = 1e-6;

/// An `f64` as a `u64` with the same total order (negative values first).
fn order_bits(x: f64) -> u64 {
    let bits = x.to_bits();
    if bits >> 63 == 1 {
        !bits
    } else {
        bits | 1 << 63
    }
}

/// The inverse of [`order_bits`].
fn from_order_bits(key: u64) -> f64 {
    if key >> 63 == 1 {
        f64::from_bits(key & !(1 << 63))
    } else {
        f64::from_bits(!key)
    }
}

/// How far the prior prefill rate may rise above the lowest one the keys were set with before
/// every key is set again: the bound of an endpoint that holds nothing loosens by as much.
const PRIOR_DRIFT: f64 = 0.001;

/// The endpoints in increasing order of a lower bound of their cost per prompt token while
/// they hold nothing of a prompt ("key"), kept by the fleet as their load and prefill rate
/// change, with a lower bound of their busy count (requests decoding and queued, as the
/// scheduler reads them).
///
/// An endpoint's key is [`cost::floor_per_token_second`] of its busy count over its costed
/// prefill rate had the decision the prior rate the keys assume (its own observed rate and that
/// prior mixed by its freshness: `f × own + (1 − f) × prior`). A decision whose prior is higher
/// costs it at most that rate times the ratio of the priors (both parts of the mix grow by at
/// most that ratio), so a key times [`LoadOrder::scale`] stays a bound.
///
/// A key may count a scraped load sample only while the sample is fresh: the owner says when
/// each counted sample expires ([`LoadOrder::sample_expires`]), and [`LoadOrder::expire`] hands
/// back the endpoints whose sample expired, whose key must be set again without it. Without
/// its sample an endpoint's busy count is only the router's own, never more than with it, so a
/// key set while the sample counted stays a lower bound until then.
///
/// Besides the fleet-wide order, one order per (model, block size) an endpoint serves holds
/// the endpoints a request of that model can use: present, healthy and not ejected
/// ([`LoadOrder::set_plannable`]; an ejection's end is handed back by [`LoadOrder::expire`]).
/// A plan walks only its request's order ([`LoadOrder::iter_serving`]): an idle endpoint that
/// no request of the model could use would otherwise be walked, and viewed, first on every
/// decision.
#[derive(Debug)]
pub struct LoadOrder {
    by_key: BTreeSet<(u64, u32)>,
    /// The (model, block size) orders, by number; a number no endpoint serves any more is
    /// freed (its slot `None`) and reused, so that models coming and going do not pile up.
    groups: Vec<Option<ServingGroup>>,
    /// Each group's number, by model and block size.
    group_of: HashMap<String, Vec<(usize, u32)>>,
    /// Group numbers free for reuse.
    free_groups: Vec<u32>,
    /// The groups each endpoint serves (whether or not it is in their orders now).
    served_of: Vec<Vec<u32>>,
    /// Whether each endpoint is in its groups' orders now.
    plannable_of: Vec<bool>,
    /// Whether each endpoint is saturated as any plan will see it.
    saturated_of: Vec<bool>,
    /// When each ejected endpoint's ejection ends.
    ejections: Deadlines,
    key_of: Vec<Option<u64>>,
    busy_of: Vec<f64>,
    /// When the load sample each endpoint's key counts stops being fresh.
    expiries: Deadlines,
    /// The prior rate keys are set with now.
    prior: f64,
    /// The prior rates the keys in the order were set with (order bits, keys), and each
    /// endpoint's.
    priors: BTreeMap<u64, u32>,
    prior_of: Vec<Option<u64>>,
}

impl LoadOrder {
    /// An empty order whose keys assume the prior rate `prior` (tokens/s). A prior that is not
    /// a positive number counts as 0: keys set with it bound nothing ([`LoadOrder::scale`] is 0)
    /// until the first positive prior sets them all again ([`LoadOrder::assume_prior`]).
    pub fn new(prior: f64) -> Self {
        let prior = if prior.is_finite() && prior > 0.0 {
            prior
        } else {
            0.0
        };
        Self {
            by_key: BTreeSet::new(),
            groups: Vec::new(),
            group_of: HashMap::new(),
            free_groups: Vec::new(),
            served_of: Vec::new(),
            plannable_of: Vec::new(),
            saturated_of: Vec::new(),
            ejections: Deadlines::default(),
            key_of: Vec::new(),
            busy_of: Vec::new(),
            expiries: Deadlines::default(),
            prior,
            priors: BTreeMap::new(),
            prior_of: Vec::new(),
        }
    }

    fn slot<T: Clone + Default>(list: &mut Vec<T>, endpoint: EndpointId) -> &mut T {
        let at = endpoint.0 as usize;
        if list.len() <= at {
            list.resize(at + 1, T::default());
        }
        &mut list[at]
    }

    /// The prior rate keys are set with now.
    pub fn prior(&self) -> f64 {
        self.prior
    }

    /// The key of an endpoint with busy count `busy` under `profile` whose costed rate at
    /// [`LoadOrder::prior`] is `rate` (tokens/s).
    pub fn key(&self, profile: &Profile, busy: f64, rate: f64) -> f64 {
        cost::floor_per_token_second(profile, busy).unwrap_or(0.0) / rate.max(1.0)
    }

    /// The lowest prior rate a key in the order was set with (the current one if none).
    fn lowest_prior(&self) -> f64 {
        self.priors
            .first_key_value()
            .map_or(self.prior, |(&bits, _)| from_order_bits(bits))
    }

    /// Keys are set with the prior rate `prior` from now on. `true` when it rose more than
    /// `PRIOR_DRIFT` (0.1%) above the lowest prior of the keys in the order: set every key again.
    /// (Keys are set again whenever an endpoint's load changes, a scrape included, so the
    /// lowest prior follows the current one without that.)
    pub fn assume_prior(&mut self, prior: f64) -> bool {
        if !(prior.is_finite() && prior > 0.0) {
            return false;
        }
        self.prior = prior;
        prior > self.lowest_prior() * (1.0 + PRIOR_DRIFT)
    }

    /// What a key is multiplied by for a decision whose prior rate is `prior`: a key assumed a
    /// prior of at least the lowest one, and a costed rate rises at most in proportion to the
    /// prior (0 for a prior that is not a positive number: no bound).
    pub fn scale(&self, prior: f64) -> f64 {
        if prior.is_finite() && prior > 0.0 {
            (self.lowest_prior() / prior).min(1.0)
        } else {
            0.0
        }
    }

    fn forget_prior(&mut self, endpoint: EndpointId) {
        if let Some(old) = Self::slot(&mut self.prior_of, endpoint).take()
            && let Some(count) = self.priors.get_mut(&old)
        {
            *count -= 1;
            if *count == 0 {
                self.priors.remove(&old);
            }
        }
    }

    /// Sets `endpoint`'s busy count bound and key (placing it in the order).
    pub fn set(&mut self, endpoint: EndpointId, busy: f64, key: f64) {
        // `+ 0.0` turns a negative zero into zero; a NaN counts as nothing.
        let key = order_bits(if key.is_nan() {
            0.0
        } else {
            key.max(0.0) + 0.0
        });
        *Self::slot(&mut self.busy_of, endpoint) = busy;
        self.forget_prior(endpoint);
        let prior = order_bits(self.prior);
        *Self::slot(&mut self.prior_of, endpoint) = Some(prior);
        *self.priors.entry(prior).or_insert(0) += 1;
        let old = Self::slot(&mut self.key_of, endpoint).replace(key);
        if old != Some(key) {
            if let Some(old) = old {
                self.by_key.remove(&(old, endpoint.0));
            }
            self.by_key.insert((key, endpoint.0));
            if *Self::slot(&mut self.plannable_of, endpoint) {
                let unsaturated = !*Self::slot(&mut self.saturated_of, endpoint);
                for &g in Self::slot(&mut self.served_of, endpoint).iter() {
                    let group = Self::serving(&mut self.groups, g);
                    if let Some(old) = old {
                        group.members.remove(&(old, endpoint.0));
                    }
                    group.members.insert((key, endpoint.0));
                    if unsaturated {
                        group.unsaturated.insert(endpoint.0);
                    }
                }
            }
        }
    }

    /// Takes `endpoint` out of the order (it is no longer planned, and serves nothing).
    pub fn remove(&mut self, endpoint: EndpointId) {
        self.set_plannable(endpoint, false);
        let served = std::mem::take(Self::slot(&mut self.served_of, endpoint));
        self.unserve(&served);
        self.forget_prior(endpoint);
        if let Some(old) = Self::slot(&mut self.key_of, endpoint).take() {
            self.by_key.remove(&(old, endpoint.0));
        }
        self.sample_expires(endpoint, None);
        self.ejected_until(endpoint, None);
    }

    /// The group of (`model`, `block_size`), if an endpoint serves it.
    pub(super) fn group(&self, model: &str, block_size: usize) -> Option<u32> {
        self.group_of
            .get(model)?
            .iter()
            .find(|&&(size, _)| size == block_size)
            .map(|&(_, g)| g)
    }

    /// Group `g`, which an endpoint serves.
    fn serving(groups: &mut [Option<ServingGroup>], g: u32) -> &mut ServingGroup {
        groups[g as usize]
            .as_mut()
            .expect("a group an endpoint serves is live")
    }

    /// The group of (`model`, `block_size`), made if no endpoint served it; one more endpoint
    /// serves it.
    fn join_group(&mut self, model: &str, block_size: usize) -> u32 {
        let g = self.group(model, block_size).unwrap_or_else(|| {
            let group = ServingGroup {
                servers: 0,
                members: BTreeSet::new(),
                unsaturated: BTreeSet::new(),
            };
            let g = match self.free_groups.pop() {
                Some(g) => {
                    self.groups[g as usize] = Some(group);
                    g
                }
                None => {
                    self.groups.push(Some(group));
                    (self.groups.len() - 1) as u32
                }
            };
            self.group_of
                .entry(model.to_owned())
                .or_default()
                .push((block_size, g));
            g
        });
        Self::serving(&mut self.groups, g).servers += 1;
        g
    }

    /// One endpoint fewer serves each of `served` (its members already left): a group nobody
    /// serves is freed.
    fn unserve(&mut self, served: &[u32]) {
        for &g in served {
            let group = Self::serving(&mut self.groups, g);
            group.servers -= 1;
            if group.servers > 0 {
                continue;
            }
            self.groups[g as usize] = None;
            self.free_groups.push(g);
            self.group_of.retain(|_, sizes| {
                sizes.retain(|&(_, number)| number != g);
                !sizes.is_empty()
            });
        }
    }

    /// `endpoint` serves `models` at `block_size` (call before [`LoadOrder::set_plannable`]
    /// whenever it may have changed: cheap when it has not).
    pub fn serve(&mut self, endpoint: EndpointId, models: &[String], block_size: usize) {
        Self::slot(&mut self.served_of, endpoint);
        let same = {
            let served = &self.served_of[endpoint.0 as usize];
            served.len() == models.len()
                && served
                    .iter()
                    .zip(models)
                    .all(|(&g, model)| self.group(model, block_size) == Some(g))
        };
        if same {
            return;
        }
        let plannable = *Self::slot(&mut self.plannable_of, endpoint);
        self.set_plannable(endpoint, false);
        let mut served = Vec::with_capacity(models.len());
        for model in models {
            if self
                .group(model, block_size)
                .is_none_or(|g| !served.contains(&g))
            {
                served.push(self.join_group(model, block_size));
            }
        }
        let old = std::mem::replace(&mut self.served_of[endpoint.0 as usize], served);
        self.unserve(&old);
        self.set_plannable(endpoint, plannable);
    }

    /// Whether a plan may use `endpoint` (present, healthy, not ejected): it is in the orders
    /// of the groups it serves while it has a key.
    pub fn set_plannable(&mut self, endpoint: EndpointId, plannable: bool) {
        let was = std::mem::replace(Self::slot(&mut self.plannable_of, endpoint), plannable);
        let key = Self::slot(&mut self.key_of, endpoint).to_owned();
        let Some(key) = key else {
            return;
        };
        if was == plannable {
            return;
        }
        let unsaturated = !*Self::slot(&mut self.saturated_of, endpoint);
        for &g in Self::slot(&mut self.served_of, endpoint).iter() {
            let group = Self::serving(&mut self.groups, g);
            if plannable {
                group.members.insert((key, endpoint.0));
                if unsaturated {
                    group.unsaturated.insert(endpoint.0);
                }
            } else {
                group.members.remove(&(key, endpoint.0));
                group.unsaturated.remove(&endpoint.0);
            }
        }
    }

    /// Whether `endpoint` is saturated as any plan will see it until its load changes again
    /// (`false` where a plan might see it unsaturated: it may be viewed to tell).
    pub fn set_saturated(&mut self, endpoint: EndpointId, saturated: bool) {
        let was = std::mem::replace(Self::slot(&mut self.saturated_of, endpoint), saturated);
        let in_groups = *Self::slot(&mut self.plannable_of, endpoint)
            && Self::slot(&mut self.key_of, endpoint).is_some();
        if was == saturated || !in_groups {
            return;
        }
        for &g in Self::slot(&mut self.served_of, endpoint).iter() {
            let unsaturated = &mut Self::serving(&mut self.groups, g).unsaturated;
            if saturated {
                unsaturated.remove(&endpoint.0);
            } else {
                unsaturated.insert(endpoint.0);
            }
        }
    }

    /// `endpoint` is ejected until `at` (`None`: not ejected); [`LoadOrder::expire`] hands it
    /// back once `at` is reached. A NaN `at` ejects nothing (nothing is ejected until then).
    pub fn ejected_until(&mut self, endpoint: EndpointId, at: Option<f64>) {
        self.ejections.set(endpoint, at);
    }

    /// Whether `endpoint` is ejected (until [`LoadOrder::expire`] hands it back).
    pub fn ejected(&self, endpoint: EndpointId) -> bool {
        self.ejections.has(endpoint)
    }

    /// The load sample `endpoint`'s key counts stops being fresh at `at` (`None`: its key
    /// counts no sample). A NaN `at` (a NaN scrape time or age limit) is never fresh for the
    /// cost model: its key counts no sample either.
    pub fn sample_expires(&mut self, endpoint: EndpointId, at: Option<f64>) {
        self.expiries.set(endpoint, at);
    }

    /// Whether `endpoint`'s key may count its load sample.
    pub fn counts_sample(&self, endpoint: EndpointId) -> bool {
        self.expiries.has(endpoint)
    }

    /// Stops counting every sample that is stale at `now` (or within a slack of it), and adds
    /// their endpoints to `expired`: set their keys again.
    pub fn expire(&mut self, now: f64, expired: &mut Vec<EndpointId>) {
        self.expiries.take_due(now + EXPIRY_SLACK_S, expired);
        // An ejection ends exactly at its time (`now < until` is ejected).
        self.ejections.take_due(now, expired);
    }

    /// `endpoint`'s busy count bound, if it is in the order.
    pub fn busy(&self, endpoint: EndpointId) -> Option<f64> {
        let at = endpoint.0 as usize;
        self.key_of
            .get(at)
            .copied()
            .flatten()
            .map(|_| self.busy_of[at])
    }

    /// `endpoint`'s key, if it is in the order.
    pub fn key_of(&self, endpoint: EndpointId) -> Option<f64> {
        self.key_of
            .get(endpoint.0 as usize)
            .copied()
            .flatten()
            .map(from_order_bits)
    }

    /// Endpoints in the order.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Whether no endpoint is in the order.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// The endpoints, lowest key first, with their keys.
    pub fn iter(&self) -> impl Iterator<Item = (f64, EndpointId)> + '_ {
        self.by_key
            .iter()
            .map(|&(key, id)| (from_order_bits(key), EndpointId(id)))
    }

    /// The endpoints a request of `model` at `block_size` can use (serving it, present,
    /// healthy, not ejected), lowest key first, with their keys.
    pub fn iter_serving(
        &self,
        model: &str,
        block_size: usize,
    ) -> impl Iterator<Item = (f64, EndpointId)> + '_ {
        self.group(model, block_size)
            .into_iter()
            .filter_map(|g| self.groups[g as usize].as_ref())
            .flat_map(|g| g.members.iter())
            .map(|&(key, id)| (from_order_bits(key), EndpointId(id)))
    }

    /// Whether `endpoint` is in the order of `group` (`None`: no endpoint serves it).
    pub(super) fn in_group(&self, endpoint: EndpointId, group: Option<u32>) -> bool {
        let at = endpoint.0 as usize;
        group.is_some_and(|g| {
            self.plannable_of
                .get(at)
                .is_some_and(|&plannable| plannable)
                && self.key_of.get(at).is_some_and(Option::is_some)
                && self
                    .served_of
                    .get(at)
                    .is_some_and(|served| served.contains(&g))
        })
    }

    /// Of [`LoadOrder::iter_serving`]'s endpoints, those a plan may see unsaturated.
    pub fn unsaturated_serving(
        &self,
        model: &str,
        block_size: usize,
    ) -> impl Iterator<Item = EndpointId> + '_ {
        self.group(model, block_size)
            .into_iter()
            .filter_map(|g| self.groups[g as usize].as_ref())
            .flat_map(|g| g.unsaturated.iter())
            .map(|&id| EndpointId(id))
    }
}

/// A time per endpoint (at most one), the earliest found first.
#[derive(Debug, Default)]
struct Deadlines {
    /// (order bits of the time, endpoint).
    by_time: BTreeSet<(u64, u32)>,
    of: Vec<Option<u64>>,
}

impl Deadlines {
    /// `endpoint`'s time is `at` from now on (`None`, or a NaN: it has none).
    fn set(&mut self, endpoint: EndpointId, at: Option<f64>) {
        let key = at.filter(|at| !at.is_nan()).map(order_bits);
        let old = std::mem::replace(LoadOrder::slot(&mut self.of, endpoint), key);
        if let Some(old) = old {
            self.by_time.remove(&(old, endpoint.0));
        }
        if let Some(key) = key {
            self.by_time.insert((key, endpoint.0));
        }
    }

    /// Whether `endpoint` has a time.
    fn has(&self, endpoint: EndpointId) -> bool {
        self.of
            .get(endpoint.0 as usize)
            .is_some_and(Option::is_some)
    }

    /// Removes every time no later than `horizon`, adding its endpoint to `due`.
    fn take_due(&mut self, horizon: f64, due: &mut Vec<EndpointId>) {
        let horizon = order_bits(horizon);
        while let Some(&(key, id)) = self.by_time.first() {
            if key > horizon {
                break;
            }
            self.by_time.pop_first();
            self.of[id as usize] = None;
            due.push(EndpointId(id));
        }
    }
}

/// The order of the endpoints serving one (model, block size) that a plan may use.
#[derive(Debug)]
struct ServingGroup {
    /// Endpoints serving it (in its order or not).
    servers: u32,
    members: BTreeSet<(u64, u32)>,
    /// The members a plan may see unsaturated.
    unsaturated: BTreeSet<u32>,
}

#[cfg(test)]
mod tests;
