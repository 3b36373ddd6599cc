//! The load order's groups: one per (model, block size) served, freed once nobody serves it.

use super::*;

fn models(names: &[&str]) -> Vec<String> {
    names.iter().map(|&n| n.to_owned()).collect()
}

fn serving(order: &LoadOrder, model: &str) -> Vec<u32> {
    order.iter_serving(model, 16).map(|(_, id)| id.0).collect()
}

#[test]
fn models_that_come_and_go_do_not_pile_up_groups() {
    let mut order = LoadOrder::new(10_000.0);
    let e = EndpointId(0);
    order.set(e, 0.0, 1.0);
    order.set_plannable(e, true);
    for generation in 0..100 {
        let name = format!("adapter-{generation}");
        order.serve(e, &models(&["base", &name]), 16);
        assert_eq!(serving(&order, &name), [0]);
        assert_eq!(serving(&order, "base"), [0]);
    }
    assert_eq!(serving(&order, "adapter-98"), Vec::<u32>::new());
    assert!(order.groups.len() <= 3, "{} groups", order.groups.len());
    assert_eq!(order.group_of.len(), 2, "base and the last adapter");
}

#[test]
fn a_group_lives_while_any_endpoint_serves_it() {
    let mut order = LoadOrder::new(10_000.0);
    let (a, b) = (EndpointId(0), EndpointId(1));
    for (e, key) in [(a, 1.0), (b, 2.0)] {
        order.set(e, 0.0, key);
        order.serve(e, &models(&["m"]), 16);
        order.set_plannable(e, true);
    }
    assert_eq!(serving(&order, "m"), [0, 1]);
    order.remove(a);
    assert_eq!(serving(&order, "m"), [1], "b still serves it");
    // Another block size of the same model is another group.
    order.serve(b, &models(&["m"]), 32);
    assert_eq!(serving(&order, "m"), Vec::<u32>::new());
    assert_eq!(
        order
            .iter_serving("m", 32)
            .map(|(_, id)| id.0)
            .collect::<Vec<_>>(),
        [1]
    );
    assert_eq!(order.group_of.len(), 1);
    // The freed number is reused, and a returning endpoint joins again.
    order.set(a, 0.0, 1.0);
    order.serve(a, &models(&["m"]), 16);
    order.set_plannable(a, true);
    assert_eq!(serving(&order, "m"), [0]);
    assert_eq!(order.groups.len(), 2);
}
