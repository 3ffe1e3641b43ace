//! [`Cancel`]: a cancellation flag a blocking stage can wait on.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Set once when the run is cancelled (Ctrl-C). Cheap to clone; all clones share the flag.
#[derive(Clone, Default, Debug)]
pub struct Cancel(Arc<(Mutex<bool>, Condvar)>);

impl Cancel {
    /// A flag that is not set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Set the flag and wake every waiter.
    pub fn cancel(&self) {
        let (lock, cvar) = &*self.0;
        *lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = true;
        cvar.notify_all();
    }

    /// Whether the flag is set.
    pub fn is_cancelled(&self) -> bool {
        *self
            .0
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Block until the flag is set or `timeout` passes; returns whether it is set.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let (lock, cvar) = &*self.0;
        let guard = lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (guard, _) = cvar
            .wait_timeout_while(guard, timeout, |set| !*set)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *guard
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cancel_wakes_waiter() {
        let c = Cancel::new();
        let c2 = c.clone();
        let t = std::thread::spawn(move || c2.wait_timeout(Duration::from_secs(60)));
        c.cancel();
        assert!(t.join().unwrap());
        assert!(c.is_cancelled());
    }

    #[test]
    fn timeout_without_cancel() {
        assert!(!Cancel::new().wait_timeout(Duration::from_millis(1)));
    }
}
