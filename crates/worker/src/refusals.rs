//! Links refused at the handshake: how many may be in their handshake at once, and how often
//! a refusal is logged. Anyone who can reach a worker port can open connections; neither the
//! worker's memory nor its log may grow with them.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Links in their handshake at once; one more is closed at accept, unanswered.
pub const HANDSHAKES_PENDING_MAX: usize = 64;

/// At most one log line about refused links per this interval.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Lets one refusal line through per interval and counts the others, so the next line can
/// say how many were left out.
pub struct RefusalLog {
    interval: Duration,
    state: Mutex<LogState>,
}

struct LogState {
    last_logged: Option<Instant>,
    suppressed: u64,
}

impl RefusalLog {
    pub fn new(interval: Duration) -> RefusalLog {
        RefusalLog {
            interval,
            state: Mutex::new(LogState {
                last_logged: None,
                suppressed: 0,
            }),
        }
    }

    /// `Some(refusals left out since the last line)` when this refusal may be logged.
    pub fn admit(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().expect("never held across a panic");
        let due = state
            .last_logged
            .is_none_or(|last| now.duration_since(last) >= self.interval);
        if !due {
            state.suppressed += 1;
            return None;
        }
        state.last_logged = Some(now);
        Some(std::mem::take(&mut state.suppressed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_and_the_next_line_counts_the_rest() {
        let log = RefusalLog::new(Duration::from_secs(10));
        let start = Instant::now();
        assert_eq!(log.admit(start), Some(0));
        let within: Vec<_> = (1..=4_000)
            .map(|i| log.admit(start + Duration::from_millis(i)))
            .collect();
        assert!(
            within.iter().all(Option::is_none),
            "4,000 refusals, no line"
        );
        assert_eq!(log.admit(start + Duration::from_secs(10)), Some(4_000));
        assert_eq!(log.admit(start + Duration::from_secs(11)), None);
        assert_eq!(log.admit(start + Duration::from_secs(21)), Some(1));
    }
}
