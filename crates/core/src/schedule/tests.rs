use super::*;
use crate::index::PrefixMatch;

fn candidate(id: u32) -> Candidate {
    Candidate {
        endpoint: EndpointId(id),
        healthy: true,
        serves_model: true,
        role: Role::Both,
        load: EndpointLoad::default(),
        cache: CacheView::default(),
        prefill_tokens_per_s: 20_000.0,
    }
}

fn request(prompt_tokens: usize) -> RequestInfo {
    RequestInfo {
        prompt_tokens,
        block_size: 16,
        session_endpoint: None,
        role: Role::Both,
    }
}

fn gpu_match(id: u32, blocks: u32) -> Option<PrefixMatch> {
    Some(PrefixMatch {
        endpoint: EndpointId(id),
        blocks,
        gpu_blocks: blocks,
        cpu_blocks: 0,
        storage_blocks: 0,
    })
}

#[test]
fn idle_fleet_goes_where_the_prefix_is() {
    let mut cands: Vec<Candidate> = (0..4).map(candidate).collect();
    cands[2].cache.precise = gpu_match(2, 100);
    let d = schedule(&Profile::default(), &request(1700), &cands, 42, 0);
    assert_eq!(d.chosen(), Some(EndpointId(2)));
    assert_eq!(d.reason, "cache");
    let a = d.assessment(EndpointId(2)).unwrap();
    assert_eq!(a.cached_tokens, 1600);
    assert!(a.predicted_ttft_s < d.assessment(EndpointId(0)).unwrap().predicted_ttft_s);
}

#[test]
fn filters_remove_unhealthy_wrong_model_and_full_endpoints() {
    let mut cands: Vec<Candidate> = (0..5).map(candidate).collect();
    cands[0].healthy = false;
    cands[1].serves_model = false;
    cands[2].load.waiting = Some(50.0);
    cands[3].load.kv_usage = Some(0.99);
    let mut profile = Profile::default();
    profile.filters.max_waiting = Some(10.0);
    profile.filters.max_kv_usage = Some(0.95);
    let d = schedule(&profile, &request(100), &cands, 1, 0);
    assert_eq!(d.ranking, vec![EndpointId(4)]);
    let reasons: Vec<_> = d.assessments.iter().map(|a| a.rejected).collect();
    assert_eq!(
        reasons,
        vec![
            Some(Rejection::Unhealthy),
            Some(Rejection::WrongModel),
            Some(Rejection::QueueFull),
            Some(Rejection::KvCacheFull),
            None
        ]
    );
    let none = schedule(&profile, &request(100), &cands[..4], 1, 0);
    assert_eq!(none.chosen(), None);
    assert_eq!(none.reason, "no_candidate");
}

#[test]
fn an_untrusted_index_counts_as_empty() {
    let mut cands: Vec<Candidate> = (0..2).map(candidate).collect();
    cands[0].cache.precise = None; // stale: the router withholds it
    cands[1].load.waiting = Some(1.0);
    let d = schedule(&Profile::default(), &request(1000), &cands, 3, 0);
    assert_eq!(
        d.chosen(),
        Some(EndpointId(0)),
        "load decides when no cache is trusted"
    );
}

#[test]
fn ties_are_broken_at_random_and_round_robin_rotates() {
    let cands: Vec<Candidate> = (0..4).map(candidate).collect();
    let profile = Profile::named(ProfileName::Random);
    let chosen: std::collections::HashSet<_> = (0..64u64)
        .map(|r| {
            schedule(
                &profile,
                &request(10),
                &cands,
                r.wrapping_mul(0x1234_5678_9abc_def1),
                0,
            )
            .chosen()
        })
        .collect();
    assert_eq!(chosen.len(), 4, "every endpoint wins some ties");
    let rr = Profile::named(ProfileName::RoundRobin);
    let order: Vec<_> = (0..8)
        .map(|i| {
            schedule(&rr, &request(10), &cands, 0, i)
                .chosen()
                .unwrap()
                .0
        })
        .collect();
    assert_eq!(order, vec![0, 1, 2, 3, 0, 1, 2, 3]);
}

#[test]
fn softmax_spreads_among_near_equal_candidates() {
    let mut cands: Vec<Candidate> = (0..2).map(candidate).collect();
    cands[0].cache.precise = gpu_match(0, 10);
    cands[1].cache.precise = gpu_match(1, 9);
    let profile = Profile {
        picker: Picker::Softmax { temperature: 0.5 },
        ..Profile::default()
    };
    let wins0 = (0..400u64)
        .filter(|r| {
            schedule(
                &profile,
                &request(200),
                &cands,
                r.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                0,
            )
            .chosen()
                == Some(EndpointId(0))
        })
        .count();
    assert!((200..380).contains(&wins0), "{wins0}");
}

#[test]
fn tier_weights_prefer_gpu_hits() {
    let mut cands: Vec<Candidate> = (0..2).map(candidate).collect();
    cands[0].cache.precise = Some(PrefixMatch {
        endpoint: EndpointId(0),
        blocks: 50,
        gpu_blocks: 0,
        cpu_blocks: 50,
        storage_blocks: 0,
    });
    cands[1].cache.precise = gpu_match(1, 50);
    let d = schedule(
        &Profile::named(ProfileName::Precise),
        &request(1000),
        &cands,
        0,
        0,
    );
    assert_eq!(d.chosen(), Some(EndpointId(1)));
}

/// A discrete simulation of one hot prefix: every request shares a 2,000-token prefix plus 200
/// unique tokens, at twice the rate one endpoint can serve even with cache hits. Each endpoint
/// prefills its queue serially at 20k tokens/s; it caches the prefix once it has served it.
/// Returns (longest queue seen, share of requests per endpoint).
fn hot_prefix_run(profile: &Profile) -> (usize, Vec<f64>) {
    let (endpoints, prefix, unique, rate_per_s, seconds) =
        (4usize, 2000usize, 200usize, 200.0, 10.0);
    let tokens_per_s = 20_000.0;
    let dt = 1.0 / rate_per_s;
    let mut queues: Vec<Vec<f64>> = vec![Vec::new(); endpoints]; // remaining tokens per request
    let mut holds = vec![false; endpoints];
    holds[0] = true;
    let mut served = vec![0usize; endpoints];
    let mut longest = 0;
    let steps = (seconds * rate_per_s) as usize;
    for step in 0..steps {
        // Serve dt worth of prefill on each endpoint.
        for q in &mut queues {
            let mut budget = tokens_per_s * dt;
            while budget > 0.0 && !q.is_empty() {
                let take = q[0].min(budget);
                q[0] -= take;
                budget -= take;
                if q[0] <= 0.0 {
                    q.remove(0);
                }
            }
        }
        let candidates: Vec<Candidate> = (0..endpoints)
            .map(|e| Candidate {
                load: EndpointLoad {
                    inflight: queues[e].len() as u32,
                    inflight_prefills: queues[e].len() as u32,
                    inflight_prefill_tokens: queues[e].iter().sum::<f64>() as u64,
                    ..EndpointLoad::default()
                },
                cache: CacheView {
                    precise: if holds[e] {
                        gpu_match(e as u32, (prefix / 16) as u32)
                    } else {
                        None
                    },
                    ..CacheView::default()
                },
                prefill_tokens_per_s: tokens_per_s,
                ..candidate(e as u32)
            })
            .collect();
        let d = schedule(
            profile,
            &request(prefix + unique),
            &candidates,
            (step as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            step as u64,
        );
        let e = d.chosen().unwrap().0 as usize;
        let cost = if holds[e] { unique } else { prefix + unique };
        queues[e].push(cost as f64);
        holds[e] = true;
        served[e] += 1;
        longest = longest.max(queues.iter().map(Vec::len).max().unwrap());
    }
    (
        longest,
        served.iter().map(|&s| s as f64 / steps as f64).collect(),
    )
}

#[test]
fn default_weights_do_not_hot_spot_a_popular_prefix() {
    let (longest, shares) = hot_prefix_run(&Profile::default());
    // A cold miss costs 2,200 tokens (110 ms); a hit behind q queued hits costs (q + 1) x 10 ms,
    // so spilling pays from about 11 queued requests on: queues stay near that, never grow.
    assert!(
        longest <= 24,
        "queues stay bounded: longest {longest}, shares {shares:?}"
    );
    let busy = shares.iter().filter(|s| **s > 0.15).count();
    assert!(
        busy >= 2,
        "the hot prefix spills to other endpoints: {shares:?}"
    );
}

#[test]
fn cache_only_weights_would_hot_spot_which_is_what_the_test_above_guards() {
    let profile = Profile {
        weights: ScorerWeights {
            precise_prefix: 1.0,
            approximate_prefix: 0.0,
            load: 0.0,
            cost: 0.0,
            session: 0.0,
            balance: 0.0,
        },
        ..Profile::default()
    };
    let (longest, shares) = hot_prefix_run(&profile);
    assert!(
        longest > 100,
        "prefix-only routing melts one endpoint: {longest}, {shares:?}"
    );
}
