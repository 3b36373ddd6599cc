//! Byte budgets: how many request-body bytes the router holds at once, across requests.
//!
//! Bytes are charged as they arrive, never on a promise: a declared `Content-Length` costs
//! nothing until its bytes are read, so clients that send only headers cannot spend a budget
//! that others need. Each front end has its own budget (the API listener with the picker, the
//! admin listener apart), and a [`BudgetHold`] gives its bytes back when the last of its holders
//! (the body being read, the handler still using it) lets go.

use std::sync::Arc;

use parking_lot::Mutex;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::Semaphore;

/// A pool of bytes shared by the requests of one front end, with the gauge that shows what is
/// held.
#[derive(Clone)]
pub struct ByteBudget {
    bytes: Arc<Semaphore>,
    gauge: Gauge,
}

impl ByteBudget {
    /// A budget of `bytes` (at most `u32::MAX`: the configuration checks it), shown on `gauge`.
    pub fn new(bytes: usize, gauge: Gauge) -> Self {
        Self {
            bytes: Arc::new(Semaphore::new(bytes.min(u32::MAX as usize))),
            gauge,
        }
    }

    /// A new, empty hold on this budget for one request.
    pub fn hold(&self) -> BudgetHold {
        BudgetHold {
            budget: self.clone(),
            held: Mutex::new(0),
        }
    }

    /// Bytes not held by any request.
    pub fn available(&self) -> usize {
        self.bytes.available_permits()
    }
}

/// The bytes one request holds of a [`ByteBudget`]; given back when dropped.
pub struct BudgetHold {
    budget: ByteBudget,
    held: Mutex<u32>,
}

impl BudgetHold {
    /// Charges `bytes` that arrived; false (and nothing charged) when the budget lacks them.
    pub fn charge(&self, bytes: usize) -> bool {
        let Ok(n) = u32::try_from(bytes) else {
            return false;
        };
        let mut held = self.held.lock();
        match self.budget.bytes.try_acquire_many(n) {
            Ok(permit) => {
                permit.forget();
                *held = held.saturating_add(n);
                self.budget.gauge.inc_by(i64::from(n));
                true
            }
            Err(_) => false,
        }
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        *self.held.lock() as usize
    }
}

impl Drop for BudgetHold {
    fn drop(&mut self) {
        let held = *self.held.get_mut();
        self.budget.bytes.add_permits(held as usize);
        self.budget.gauge.dec_by(i64::from(held));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_draw_on_one_budget_and_give_it_back() {
        let gauge = Gauge::default();
        let budget = ByteBudget::new(100, gauge.clone());
        let a = budget.hold();
        assert!(a.charge(50));
        assert!(a.charge(20));
        assert_eq!((gauge.get(), a.held()), (70, 70));
        let b = budget.hold();
        assert!(!b.charge(31), "only 30 left");
        assert!(b.charge(30));
        assert!(!b.charge(1));
        drop(a);
        drop(b);
        assert_eq!((budget.available(), gauge.get()), (100, 0));
    }
}
