//! `kvroute tune`: searching a scheduling profile's parameters on a simulated fleet.
//!
//! The workload is split into a part to tune on and a held-out part (by session, or by time),
//! so the gain reported is the gain on traffic the search never saw. Each trial is one
//! simulation of the tuning part with a candidate profile; the search starts from the given
//! profile, samples the parameter box at random and refines around the best feasible profile so
//! far. A profile is feasible when its load imbalance stays within the limit (or within the
//! starting profile's, where that is already above it). The winner and the starting profile are
//! then both simulated on the held-out part. Several workloads can be tuned together
//! ([`tune_cases`]), to choose defaults that hold on all of them.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use kvroute_bench::result::{RequestRecord, RunResult};
use kvroute_bench::workload::Workload;
use kvroute_core::fleet::FleetConfig as CoreFleetConfig;
use kvroute_core::schedule::Profile;

use crate::core_policy::CorePolicy;
use crate::{FleetConfig, SimulateError, simulate_with};

/// What the search minimises.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Objective {
    /// Time to first token, 90th percentile.
    TtftP90,
    /// Time to first token, 99th percentile.
    TtftP99,
    /// The share of requests that missed a TTFT SLO or failed (1 − goodput).
    Goodput {
        /// The TTFT a request must meet, seconds.
        slo_s: f64,
    },
}

impl Objective {
    /// The objective's value for a run: lower is better.
    pub fn value(&self, run: &RunResult) -> f64 {
        match self {
            Objective::TtftP90 => run.summary.ttft.p90,
            Objective::TtftP99 => run.summary.ttft.p99,
            Objective::Goodput { slo_s } => 1.0 - goodput(&run.records, *slo_s),
        }
    }

    /// How the objective moved from `before` to `after`, as [`Objective::describe`] reads:
    /// the relative change of a latency (per cent), and of goodput its change in points (the
    /// objective's value is the share of requests that missed the SLO).
    pub fn change(&self, before: f64, after: f64) -> f64 {
        match self {
            Objective::Goodput { .. } => (before - after) * 100.0,
            Objective::TtftP90 | Objective::TtftP99 if before > 0.0 => {
                (after - before) / before * 100.0
            }
            Objective::TtftP90 | Objective::TtftP99 => 0.0,
        }
    }

    /// The unit of [`Objective::change`]: `%`, or ` points` for goodput.
    pub fn change_unit(&self) -> &'static str {
        match self {
            Objective::Goodput { .. } => " points",
            Objective::TtftP90 | Objective::TtftP99 => "%",
        }
    }

    /// How the value reads in reports.
    pub fn describe(&self, value: f64) -> String {
        match self {
            Objective::TtftP90 => format!("TTFT p90 {:.1} ms", value * 1e3),
            Objective::TtftP99 => format!("TTFT p99 {:.1} ms", value * 1e3),
            Objective::Goodput { slo_s } => format!(
                "goodput {:.1}% (TTFT ≤ {:.0} ms)",
                (1.0 - value) * 100.0,
                slo_s * 1e3
            ),
        }
    }
}

/// Share of requests that succeeded with a TTFT within `slo_s`.
fn goodput(records: &[RequestRecord], slo_s: f64) -> f64 {
    if records.is_empty() {
        return 0.0;
    }
    let good = records
        .iter()
        .filter(|r| r.error.is_none() && r.ttft_s.is_some_and(|t| t <= slo_s))
        .count();
    good as f64 / records.len() as f64
}

/// How the held-out part is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// Sessions ordered by a hash of their id; the last share of that order is held out.
    Session,
    /// The sessions that start last are held out.
    Time,
}

/// The search's settings.
#[derive(Clone, Debug, Serialize)]
pub struct TuneConfig {
    /// What to minimise.
    pub objective: Objective,
    /// Largest load imbalance (busiest endpoint's requests over the mean) allowed.
    pub max_imbalance: f64,
    /// Simulations of the tuning part, the starting profile included.
    pub trials: usize,
    /// Share of the sessions held out (0–1).
    pub holdout: f64,
    /// How they are chosen.
    pub split: Split,
    /// Seed of the search.
    pub seed: u64,
}

/// One searched parameter of a profile.
pub struct Param {
    /// Its name in the configuration (`scheduler.<name>`).
    pub name: &'static str,
    /// Smallest value searched.
    pub low: f64,
    /// Largest value searched.
    pub high: f64,
    /// Searched on a log scale (weights, rates) rather than a linear one.
    pub log: bool,
    get: fn(&Profile) -> f64,
    set: fn(&mut Profile, f64),
}

impl Param {
    /// The parameter's value in `profile`.
    pub fn get(&self, profile: &Profile) -> f64 {
        (self.get)(profile)
    }

    fn clamp(&self, v: f64) -> f64 {
        v.clamp(self.low, self.high)
    }

    fn random(&self, rng: &mut StdRng) -> f64 {
        let u: f64 = rng.random();
        if self.log {
            (self.low.ln() + u * (self.high.ln() - self.low.ln())).exp()
        } else {
            self.low + u * (self.high - self.low)
        }
    }

    /// A value near `v`: up to a factor of 2 either way (log), or a fifth of the range.
    fn near(&self, v: f64, rng: &mut StdRng) -> f64 {
        let u: f64 = rng.random_range(-1.0..1.0);
        self.clamp(if self.log {
            v.max(self.low) * 2f64.powf(u)
        } else {
            v + u * (self.high - self.low) / 5.0
        })
    }
}

/// Every parameter the search varies: the cost model's weights (eviction included), the
/// balancing tolerance, the wait per queued request and the saturation threshold of flow
/// control. Not searched: the tier rates (measured properties of the hardware) and the session
/// credit (simulated clients name no session).
pub const PARAMS: [Param; 8] = [
    Param {
        name: "weights.prefix",
        low: 0.25,
        high: 4.0,
        log: true,
        get: |p| p.weights.prefix,
        set: |p, v| p.weights.prefix = v,
    },
    Param {
        name: "weights.load",
        low: 0.25,
        high: 4.0,
        log: true,
        get: |p| p.weights.load,
        set: |p, v| p.weights.load = v,
    },
    Param {
        name: "weights.decode_interference",
        low: 0.0,
        high: 2.0,
        log: false,
        get: |p| p.weights.decode_interference,
        set: |p, v| p.weights.decode_interference = v,
    },
    Param {
        name: "weights.eviction",
        low: 0.0,
        high: 2.0,
        log: false,
        get: |p| p.weights.eviction,
        set: |p, v| p.weights.eviction = v,
    },
    Param {
        name: "balance.absolute_s",
        low: 0.0,
        high: 0.02,
        log: false,
        get: |p| p.balance.absolute_s,
        set: |p, v| p.balance.absolute_s = v,
    },
    Param {
        name: "balance.relative",
        low: 0.0,
        high: 0.5,
        log: false,
        get: |p| p.balance.relative,
        set: |p, v| p.balance.relative = v,
    },
    Param {
        name: "queue_wait_s",
        low: 0.0,
        high: 0.1,
        log: false,
        get: |p| p.queue_wait_s,
        set: |p, v| p.queue_wait_s = v,
    },
    Param {
        name: "saturation.queue",
        low: 1.0,
        high: 32.0,
        log: true,
        get: |p| p.saturation.queue,
        set: |p, v| p.saturation.queue = v.round(),
    },
];

/// One workload on one fleet; several are tuned together to choose defaults that hold on all.
pub struct Case {
    /// Its name in reports.
    pub name: String,
    /// The fleet.
    pub fleet: FleetConfig,
    /// The workload (split into a tuning and a held-out part).
    pub workload: Workload,
    /// Closed loop with this many sessions, or open loop.
    pub concurrency: Option<usize>,
}

/// One simulated trial.
#[derive(Clone, Debug, Serialize)]
pub struct Trial {
    /// Each parameter's value, in [`PARAMS`] order.
    pub values: Vec<f64>,
    /// The objective on the tuning part (lower is better): the objective itself with one case,
    /// the mean of each case's objective over the starting profile's with several.
    pub value: f64,
    /// The largest load imbalance over the cases.
    pub imbalance: f64,
    /// Whether every case's imbalance is within the limit (or within the starting profile's,
    /// where that is already above it) and no request failed.
    pub feasible: bool,
}

/// One case's held-out comparison.
pub struct CaseResult {
    /// The case's name.
    pub name: String,
    /// The starting profile on the held-out part.
    pub baseline: RunResult,
    /// The best profile on the held-out part.
    pub tuned: RunResult,
}

/// What a search found.
pub struct TuneOutcome {
    /// The best feasible profile (the starting one if none beat it).
    pub best: Profile,
    /// Every trial, in order; the first is the starting profile.
    pub trials: Vec<Trial>,
    /// Each case on its held-out part.
    pub cases: Vec<CaseResult>,
}

/// Splits `workload` into (tuning part, held-out part).
pub fn split(workload: &Workload, holdout: f64, how: Split) -> (Workload, Workload) {
    let holdout = holdout.clamp(0.0, 1.0);
    let mut order: Vec<usize> = (0..workload.sessions.len()).collect();
    match how {
        Split::Time => order.sort_by(|&a, &b| {
            workload.sessions[a]
                .start_s
                .total_cmp(&workload.sessions[b].start_s)
        }),
        Split::Session => order.sort_by_key(|&i| mix(workload.sessions[i].id)),
    }
    let keep = order.len() - (order.len() as f64 * holdout).round() as usize;
    let part = |indices: &[usize], label: &str| {
        let mut sessions: Vec<_> = indices
            .iter()
            .map(|&i| workload.sessions[i].clone())
            .collect();
        sessions.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
        // Each part starts at its first arrival. A part held out by time keeps the gaps between
        // arrivals (its offered rate is the whole's already); one of sessions drawn from the
        // whole run spans all of it with fewer sessions, so its gaps shrink by its share, to
        // replay it at the whole's offered rate (a lighter load is a different regime).
        let first = sessions.first().map_or(0.0, |s| s.start_s);
        let scale = match how {
            Split::Time => 1.0,
            Split::Session => sessions.len() as f64 / workload.sessions.len().max(1) as f64,
        };
        for s in &mut sessions {
            s.start_s = (s.start_s - first) * scale;
        }
        Workload {
            description: serde_json::json!({"part": label, "of": workload.description}),
            api: workload.api,
            sessions,
        }
    };
    (
        part(&order[..keep], "tune"),
        part(&order[keep..], "holdout"),
    )
}

fn mix(id: u64) -> u64 {
    let mut x = id.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 31;
    x.wrapping_mul(0xbf58_476d_1ce4_e5b9)
}

fn evaluate(
    name: &str,
    profile: &Profile,
    fleet: &FleetConfig,
    workload: &Workload,
    concurrency: Option<usize>,
) -> Result<RunResult, SimulateError> {
    let mut policy = CorePolicy::new(profile.clone(), CoreFleetConfig::default(), fleet)?;
    simulate_with(name, fleet, workload, concurrency, &mut policy)
}

/// Searches `start`'s parameters for `workload` on `fleet`; `progress` is called after each
/// simulation with (done, total).
pub fn tune(
    fleet: &FleetConfig,
    workload: &Workload,
    concurrency: Option<usize>,
    start: &Profile,
    config: &TuneConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<TuneOutcome, SimulateError> {
    let case = Case {
        name: "workload".into(),
        fleet: fleet.clone(),
        workload: workload.clone(),
        concurrency,
    };
    tune_cases(std::slice::from_ref(&case), start, config, progress)
}

/// A case's two parts.
struct Parts<'a> {
    case: &'a Case,
    tuning: Workload,
    held_out: Workload,
}

/// Searches `start`'s parameters for every case together: a profile must be feasible on
/// each, and is scored by its mean objective relative to the starting profile's.
pub fn tune_cases(
    cases: &[Case],
    start: &Profile,
    config: &TuneConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<TuneOutcome, SimulateError> {
    let mut parts = Vec::with_capacity(cases.len());
    for case in cases {
        let (tuning, held_out) = split(&case.workload, config.holdout, config.split);
        if tuning.sessions.is_empty() || held_out.sessions.is_empty() {
            return Err(SimulateError::Config(format!(
                "{}: the workload is too small to hold part of it out: use more sessions or another --holdout",
                case.name
            )));
        }
        parts.push(Parts {
            case,
            tuning,
            held_out,
        });
    }
    let runs = config.trials.max(1);
    let total = (runs + 2) * cases.len();
    let mut done = 0;
    let mut rng = StdRng::seed_from_u64(config.seed);
    let mut trials: Vec<Trial> = Vec::new();
    // The starting profile's objective and imbalance per case (trial 0).
    let mut baseline: Vec<(f64, f64)> = Vec::new();
    let mut best: Option<(Profile, f64)> = None;
    for t in 0..runs {
        let mut profile = start.clone();
        if t > 0 {
            // Half the trials explore the whole box, half refine around the best so far.
            let around = best.as_ref().filter(|_| t % 2 == 0).map(|(p, _)| p.clone());
            for param in &PARAMS {
                let v = match &around {
                    Some(p) => param.near(param.get(p), &mut rng),
                    None => param.random(&mut rng),
                };
                (param.set)(&mut profile, v);
            }
        }
        let mut values = Vec::with_capacity(parts.len());
        let mut feasible = true;
        let mut imbalance: f64 = 0.0;
        for (i, part) in parts.iter().enumerate() {
            let c = part.case;
            let run = evaluate("trial", &profile, &c.fleet, &part.tuning, c.concurrency)?;
            let value = config.objective.value(&run);
            let case_imbalance = run.summary.load_imbalance;
            if t == 0 {
                baseline.push((value, case_imbalance));
            }
            let limit = config.max_imbalance.max(baseline[i].1);
            feasible &= case_imbalance <= limit && run.summary.errors == 0;
            imbalance = imbalance.max(case_imbalance);
            values.push(value);
            done += 1;
            progress(done, total);
        }
        let value = if values.len() == 1 {
            values[0]
        } else {
            values
                .iter()
                .zip(&baseline)
                .map(|(v, (b, _))| if *b > 0.0 { v / b } else { 1.0 })
                .sum::<f64>()
                / values.len() as f64
        };
        trials.push(Trial {
            values: PARAMS.iter().map(|p| p.get(&profile)).collect(),
            value,
            imbalance,
            feasible,
        });
        if feasible && best.as_ref().is_none_or(|(_, b)| value < *b) {
            best = Some((profile, value));
        }
    }
    let best = best.map_or_else(|| start.clone(), |(p, _)| p);
    let mut results = Vec::with_capacity(parts.len());
    for part in &parts {
        let c = part.case;
        let baseline = evaluate("defaults", start, &c.fleet, &part.held_out, c.concurrency)?;
        let tuned = evaluate("tuned", &best, &c.fleet, &part.held_out, c.concurrency)?;
        done += 2;
        progress(done, total);
        results.push(CaseResult {
            name: c.name.clone(),
            baseline,
            tuned,
        });
    }
    Ok(TuneOutcome {
        best,
        trials,
        cases: results,
    })
}

/// The tuned parameters as a `kvroute serve` configuration snippet.
pub fn yaml_snippet(policy: &str, profile: &Profile) -> String {
    let (w, b, s) = (&profile.weights, &profile.balance, &profile.saturation);
    format!(
        "scheduler:\n  policy: {policy}\n  weights: {{prefix: {:.3}, load: {:.3}, decode_interference: {:.3}, eviction: {:.3}}}\n  balance: {{relative: {:.3}, absolute_s: {:.4}}}\n  queue_wait_s: {:.4}\n  saturation: {{queue: {}, kv_usage: {}}}\n",
        w.prefix,
        w.load,
        w.decode_interference,
        w.eviction,
        b.relative,
        b.absolute_s,
        profile.queue_wait_s,
        s.queue,
        s.kv_usage,
    )
}
