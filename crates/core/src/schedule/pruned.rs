//! Costing only the endpoints that can come near the best, so that a decision's work follows
//! the endpoints that can win, not the fleet's size.
//!
//! An endpoint's cost is at least [`cost::cost_floor`] of what it can hold of the prompt at
//! most, its requests decoding and queued ("busy") and its prefill rate: a bound that grows with
//! `busy` and shrinks with what it holds and its rate. An endpoint that holds none of the
//! prompt's blocks as the cost counts them ([`cost::countable_blocks`]: no trusted index match
//! on any tier, no prediction, no routing history where that is read) differs from every other
//! such endpoint only through its load and rate: [`LoadOrder`] keeps the endpoints
//! ordered by a lower bound of their cost per prompt token then, updated when their load or rate
//! changes. [`schedule_pruned`] costs the session's endpoint, then two streams, each in
//! increasing order of its bound: the endpoints that hold part of the prompt (a short list,
//! sorted by their bound at each decision) and the
//! rest (the load order). A stream ends at the first endpoint whose bound exceeds every cost the
//! decision can still read:
//! - the cost of the `depth`-th best so far (the head of the ranking, ties included: a bound
//!   equal to it is still costed);
//! - the most the balance limit can be (the cheapest's cost plus the tolerance taken of all of
//!   it, [`super::BalanceTolerance::limit_at_most`]), which balancing reads among
//!   the costs that hold at least as much as the cheapest: for the holders always, for the rest
//!   (which hold nothing) only while the cheapest holds nothing.
//!
//! Both only fall as endpoints are costed, so every endpoint left out costs more than both at
//! the end: it is neither in the head of the ranking nor among the near-equal costs, and the
//! winner, reason and head are those of [`super::schedule`]. The walk does not stop before more
//! than `depth` competitors are costed (with fewer, the caller ranks everything as before).
//! Whether every competitor is saturated is a fact about all of them: when none costed is
//! unsaturated, the order's endpoints that may be unsaturated ([`LoadOrder::set_saturated`],
//! kept as their load changes) are viewed until one is; a saturated fleet has none.
//!
//! On a fleet of prefill and decode roles (P/D) the plan also ranks the head of each role
//! ([`super::role_heads`]): an endpoint is costed while its bound can reach the head of a role
//! it can serve, and a stream ends past the highest of the stops. Until `depth` of a role are
//! costed, every endpoint of that role met is. Under P/D the request is held when every
//! competing decoder is saturated: past those costed, the order's decoders that may be
//! unsaturated are viewed until one is.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::near_best::{Ranked, Standing, by_cost};
use super::role_heads::{ROLES, rank_role_heads};
use super::{
    Candidate, Decision, EndpointLoad, Picker, Profile, RequestInfo, Role, cost, rejection,
    saturated,
};
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
    /// When each ejected endpoint's ejection ends (order bits, endpoint).
    ejections: BTreeSet<(u64, u32)>,
    ejection_of: Vec<Option<u64>>,
    key_of: Vec<Option<u64>>,
    busy_of: Vec<f64>,
    expiries: BTreeSet<(u64, u32)>,
    expiry_of: Vec<Option<u64>>,
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
            ejections: BTreeSet::new(),
            ejection_of: Vec::new(),
            key_of: Vec::new(),
            busy_of: Vec::new(),
            expiries: BTreeSet::new(),
            expiry_of: Vec::new(),
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
    fn group(&self, model: &str, block_size: usize) -> Option<u32> {
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
        let key = at.filter(|at| !at.is_nan()).map(order_bits);
        let old = std::mem::replace(Self::slot(&mut self.ejection_of, endpoint), key);
        if let Some(old) = old {
            self.ejections.remove(&(old, endpoint.0));
        }
        if let Some(key) = key {
            self.ejections.insert((key, endpoint.0));
        }
    }

    /// Whether `endpoint` is ejected (until [`LoadOrder::expire`] hands it back).
    pub fn ejected(&self, endpoint: EndpointId) -> bool {
        self.ejection_of
            .get(endpoint.0 as usize)
            .is_some_and(Option::is_some)
    }

    /// The load sample `endpoint`'s key counts stops being fresh at `at` (`None`: its key
    /// counts no sample). A NaN `at` (a NaN scrape time or age limit) is never fresh for the
    /// cost model: its key counts no sample either.
    pub fn sample_expires(&mut self, endpoint: EndpointId, at: Option<f64>) {
        let key = at.filter(|at| !at.is_nan()).map(order_bits);
        let old = std::mem::replace(Self::slot(&mut self.expiry_of, endpoint), key);
        if let Some(old) = old {
            self.expiries.remove(&(old, endpoint.0));
        }
        if let Some(key) = key {
            self.expiries.insert((key, endpoint.0));
        }
    }

    /// Whether `endpoint`'s key may count its load sample.
    pub fn counts_sample(&self, endpoint: EndpointId) -> bool {
        self.expiry_of
            .get(endpoint.0 as usize)
            .is_some_and(Option::is_some)
    }

    /// Stops counting every sample that is stale at `now` (or within a slack of it), and adds
    /// their endpoints to `expired`: set their keys again.
    pub fn expire(&mut self, now: f64, expired: &mut Vec<EndpointId>) {
        let horizon = order_bits(now + EXPIRY_SLACK_S);
        while let Some(&(key, id)) = self.expiries.first() {
            if key > horizon {
                break;
            }
            self.expiries.pop_first();
            self.expiry_of[id as usize] = None;
            expired.push(EndpointId(id));
        }
        // An ejection ends exactly at its time (`now < until` is ejected).
        let now_bits = order_bits(now);
        while let Some(&(key, id)) = self.ejections.first() {
            if key > now_bits {
                break;
            }
            self.ejections.pop_first();
            self.ejection_of[id as usize] = None;
            expired.push(EndpointId(id));
        }
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
    fn in_group(&self, endpoint: EndpointId, group: Option<u32>) -> bool {
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

/// Whether an endpoint with `load` is saturated under `profile` (as the scheduler reads it).
pub fn saturated_load(profile: &Profile, load: &EndpointLoad) -> bool {
    saturated(profile, load)
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

/// Buffers [`schedule_pruned`] reuses between decisions.
#[derive(Debug, Default)]
pub struct PruneBuffers {
    candidates: Vec<Candidate>,
    standings: Vec<Standing>,
    best: Vec<f64>,
    /// Under P/D, the best costs of each role ([`ROLES`]).
    role_best: [Vec<f64>; 2],
    by_floor: Vec<(f64, EndpointId)>,
}

/// What the walk has found so far.
struct Walk<'b> {
    depth: usize,
    random: u64,
    cheapest: Option<Standing>,
    any_unsaturated: bool,
    candidates: &'b mut Vec<Candidate>,
    standings: &'b mut Vec<Standing>,
    /// The best costs so far, cheapest first, at most `depth` of them.
    best: &'b mut Vec<f64>,
    /// Under P/D, the same of each role's competitors ([`ROLES`]); `None` otherwise.
    role_best: Option<&'b mut [Vec<f64>; 2]>,
}

/// Keeps `cost` among `best` (cheapest first) if it is one of the `depth` cheapest.
fn keep_best(best: &mut Vec<f64>, cost: f64, depth: usize) {
    let at = best.partition_point(|b| b.total_cmp(&cost).is_le());
    if at < depth {
        best.insert(at, cost);
        best.truncate(depth);
    }
}

impl Walk<'_> {
    /// Costs `c` and, if it competes, keeps its standing.
    fn consider(&mut self, profile: &Profile, request: &RequestInfo, c: Candidate) {
        if rejection(profile, request, &c).is_some() {
            return;
        }
        let (cost, cached) = cost::assess(profile, request, &c);
        self.any_unsaturated |= !saturated(profile, &c.load);
        let s = Standing::of(
            profile,
            &c,
            self.candidates.len(),
            &cost,
            cached.all,
            self.random,
        );
        if self.cheapest.is_none_or(|b| by_cost(&s, &b).is_lt()) {
            self.cheapest = Some(s);
        }
        keep_best(self.best, s.total, self.depth);
        if let Some(role_best) = self.role_best.as_deref_mut() {
            for (fits, best) in ROLES.iter().zip(role_best.iter_mut()) {
                if fits(c.role) {
                    keep_best(best, s.total, self.depth);
                }
            }
        }
        self.standings.push(s);
        self.candidates.push(c);
    }

    /// The highest cost a decision can still read from an endpoint that holds part of the
    /// prompt (`holds`) or none of it, over the fleet's head and the balance limit (`None`:
    /// any).
    fn stop(&self, profile: &Profile, holds: bool) -> Option<f64> {
        let cheapest = self.cheapest?;
        if self.standings.len() <= self.depth {
            return None;
        }
        let head = self.best[self.depth - 1];
        Some(if holds || cheapest.held.cached == 0 {
            // The cheapest can only get cheaper, and `limit_at_most` of it bounds its limit.
            head.max(profile.balance.limit_at_most(cheapest.total))
        } else {
            head
        })
    }

    /// [`Walk::stop`] for an endpoint whose role `fits` each of [`ROLES`] as `fits` says:
    /// under P/D, also the cost of the `depth`-th best of each role it fits (`None`: any, while
    /// fewer of that role were costed). `fits` all `true`: the highest stop of any endpoint.
    fn stop_for(&self, profile: &Profile, holds: bool, fits: [bool; 2]) -> Option<f64> {
        let fleet = self.stop(profile, holds)?;
        let Some(role_best) = self.role_best.as_deref() else {
            return Some(fleet);
        };
        let mut stop = fleet;
        for (best, _) in role_best.iter().zip(fits).filter(|(_, fits)| *fits) {
            stop = stop.max(*best.get(self.depth - 1)?);
        }
        Some(stop)
    }
}

/// Where a pruned plan looks for its candidates, and how it bounds them.
pub struct PruneScope<'a> {
    /// Every endpoint holding part of the prompt as the profile's cache source counts it
    /// ([`cost::countable_blocks`]), sorted by endpoint, with at least the tokens that source
    /// can count and at least its costed prefill rate. Every other endpoint is bounded as
    /// holding nothing.
    pub holders: &'a [(EndpointId, usize, f64)],
    /// The fleet's load order.
    pub order: &'a LoadOrder,
    /// The request's model and block size: only the endpoints of that order are walked (the
    /// others are rejected by every plan).
    pub serving: (&'a str, usize),
    /// The prior prefill rate of this decision's costed rates.
    pub prior_rate: f64,
    /// On a fleet of prefill and decode roles (P/D), each endpoint's role: the head of each
    /// role is ranked too ([`super::RankBuffers::rank_role_heads`]), and the plan is saturated
    /// when every competing decoder is ([`super::decoders_saturated`]). `None`: whole requests
    /// only.
    pub roles: Option<&'a dyn Fn(EndpointId) -> Role>,
}

/// Ranks the best `depth` (at least 2) endpoints for `request` as [`super::schedule_near_best`]
/// does over every endpoint (and, under P/D, the best `depth` of each role as
/// [`super::RankBuffers::rank_role_heads`] does), costing only those that can matter (see the
/// module's doc): the session's endpoint, the holders and the rest of the order, each while its
/// bound can reach the head, its role's head or the balance limit. `candidate` builds an
/// endpoint's view. `None` when the profile's picker reads every candidate, or when no more
/// than `depth` endpoints compete (rank them all then).
pub fn schedule_pruned(
    profile: &Profile,
    request: &RequestInfo,
    scope: &PruneScope<'_>,
    mut candidate: impl FnMut(EndpointId) -> Candidate,
    random: u64,
    depth: usize,
    buffers: &mut PruneBuffers,
) -> Option<Decision> {
    let depth = depth.max(2);
    if profile.picker != Picker::Cheapest {
        return None;
    }
    let PruneScope {
        holders,
        order,
        serving,
        prior_rate,
        roles,
    } = *scope;
    let PruneBuffers {
        candidates,
        standings,
        best,
        role_best,
        by_floor,
    } = buffers;
    candidates.clear();
    standings.clear();
    best.clear();
    role_best.iter_mut().for_each(Vec::clear);
    let session = request.session_endpoint;
    // The holders by their bound, but those out of the request's order (another model or
    // block size, unhealthy, ejected, gone): every plan rejects them.
    let group = order.group(serving.0, serving.1);
    by_floor.clear();
    let competing = |id: EndpointId| Some(id) != session && order.in_group(id, group);
    by_floor.extend(
        holders
            .iter()
            .filter(|(id, ..)| competing(*id))
            .map(|&(id, held, rate)| {
                let bound = order
                    .busy(id)
                    .and_then(|busy| cost::cost_floor(profile, request, held, busy, rate));
                (bound.unwrap_or(f64::NEG_INFINITY), id)
            }),
    );
    by_floor.sort_unstable_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut walk = Walk {
        depth,
        random,
        cheapest: None,
        any_unsaturated: false,
        candidates,
        standings,
        best,
        role_best: roles.is_some().then_some(role_best),
    };
    if let Some(id) = session {
        walk.consider(profile, request, candidate(id));
    }
    let mut held = by_floor.iter().copied().peekable();
    // The rest hold nothing: the whole prompt is uncached (see `LoadOrder` for the key).
    let per_key = match cost::floor_per_token_second(profile, 0.0) {
        Some(_) => request.prompt_tokens as f64 * order.scale(prior_rate) * (1.0 - 1e-9),
        None => f64::NEG_INFINITY,
    };
    let mut rest = order
        .iter_serving(serving.0, serving.1)
        .filter(|&(_, id)| {
            Some(id) != session && holders.binary_search_by_key(&id, |h| h.0).is_err()
        })
        .map(|(key, id)| (key * per_key, id))
        .peekable();
    // A stream ends at its first bound past the highest stop: every later one of it is bounded
    // higher, and the stops only fall. The other stream goes on. Under P/D an endpoint below
    // that but past its own role's stop is passed over.
    let (mut held_done, mut rest_done) = (false, false);
    loop {
        let next_held = held.peek().copied().filter(|_| !held_done);
        let next_rest = rest.peek().copied().filter(|_| !rest_done);
        let take_held = match (next_held, next_rest) {
            (None, None) => break,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (Some(h), Some(r)) => h.0 <= r.0,
        };
        let (bound, id) = if take_held { next_held } else { next_rest }.expect("one is next");
        let past = |fits| {
            walk.stop_for(profile, take_held, fits)
                .is_some_and(|stop| bound > stop)
        };
        if past([true; 2]) {
            if take_held {
                held_done = true;
            } else {
                rest_done = true;
            }
            continue;
        }
        if take_held {
            held.next();
        } else {
            rest.next();
        }
        let fits = roles.map_or([true; 2], |role_of| ROLES.map(|fits| fits(role_of(id))));
        if !past(fits) {
            walk.consider(profile, request, candidate(id));
        }
    }
    if walk.standings.len() <= depth {
        return None;
    }
    if !walk.any_unsaturated {
        walk.any_unsaturated = order.unsaturated_serving(serving.0, serving.1).any(|id| {
            let c = candidate(id);
            rejection(profile, request, &c).is_none() && !saturated(profile, &c.load)
        });
    }
    let ranked = Ranked {
        all_saturated: !walk.any_unsaturated,
        depth,
        by_endpoint: true,
    };
    let mut decision = ranked.decide(profile, request, walk.candidates, walk.standings);
    if let Some(role_of) = roles {
        rank_role_heads(
            profile,
            request,
            walk.candidates,
            walk.standings,
            &mut decision,
            depth,
        );
        decision.saturated = decision.saturated || {
            let decoders = Decoders {
                profile,
                request,
                order,
                serving,
                role_of,
            };
            decoders.all_saturated(walk.candidates, &mut candidate)
        };
    }
    Some(decision)
}

/// A pruned P/D plan's decoders: whether every competing one is saturated, found from those
/// the walk costed and, past them, the order's.
struct Decoders<'a> {
    profile: &'a Profile,
    request: &'a RequestInfo,
    order: &'a LoadOrder,
    serving: (&'a str, usize),
    role_of: &'a dyn Fn(EndpointId) -> Role,
}

impl Decoders<'_> {
    /// Whether some decoder competes and every competing one is saturated, as
    /// [`super::decoders_saturated`] finds over every candidate: `costed` are the walk's
    /// competitors; past them, the order's decoders that may be unsaturated are viewed until
    /// one is. Whether one competes at all is known from `costed` alone: while fewer than
    /// `depth` decoders are costed, no stream ends ([`Walk::stop_for`]), so every endpoint of
    /// the request's order is met and every decoder met is costed (those outside the order,
    /// and those `rejection` turns away, compete in no plan): none costed means none competes.
    fn all_saturated(
        &self,
        costed: &[Candidate],
        candidate: &mut impl FnMut(EndpointId) -> Candidate,
    ) -> bool {
        let (profile, request) = (self.profile, self.request);
        let mut costed_decoders = costed.iter().filter(|c| c.role.decodes()).peekable();
        let any_competes = costed_decoders.peek().is_some();
        if costed_decoders.any(|c| !saturated(profile, &c.load)) {
            return false;
        }
        let (model, block_size) = self.serving;
        let unsaturated = self
            .order
            .unsaturated_serving(model, block_size)
            .filter(|id| (self.role_of)(*id).decodes())
            .any(|id| {
                let c = candidate(id);
                rejection(profile, request, &c).is_none() && !saturated(profile, &c.load)
            });
        any_competes && !unsaturated
    }
}

#[cfg(test)]
mod tests;
