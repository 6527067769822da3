//! Retries, from one configuration: object_store retries each request (its `RetryConfig` is built
//! here), and a read resumes a body that broke off, asking a [`ResumeState`] whether to go on and
//! how long to wait first.

use std::fmt;
use std::time::{Duration, Instant};

use object_store::{BackoffConfig, RetryConfig};

/// How hard reads try before giving up. Storage options can override `max_retries` and
/// `retry_timeout` for the requests of one store (`config::split_retry_options`).
#[derive(Debug, Clone)]
pub struct RetrySettings {
    /// Waits between attempts: `init_backoff`, times `base` after each attempt, at most
    /// `max_backoff`.
    pub backoff: BackoffConfig,
    /// Retries of one request (5xx, 429, SlowDown, connection errors) before it fails.
    pub max_retries: usize,
    /// Time after which object_store stops retrying a request, and a read that made no progress
    /// for that long stops resuming: a dead endpoint fails in about a minute, not many.
    pub retry_timeout: Duration,
    /// Resumptions in a row that bring no new byte (or bring them below `min_rate`) before a
    /// read gives up (each one already went through object_store's retries).
    pub max_stalled_resumes: u32,
    /// The stall rule: a body that brings fewer than `min_rate` bytes per second, measured over
    /// `stall_window`, is cancelled and requested again on a fresh connection, and counts as an
    /// attempt without progress. `min_rate` 0 turns the rule off. Defaults: a dead-slow server
    /// fails a read in about a minute (windows of 20 s until `retry_timeout` passes without
    /// progress, at most `max_stalled_resumes` + 1 of them), while a healthy link (tens of MB/s
    /// per connection) is 1000 times over the bar.
    pub min_rate: u64,
    pub stall_window: Duration,
}

impl Default for RetrySettings {
    fn default() -> Self {
        RetrySettings {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(8),
                base: 2.0,
            },
            max_retries: 6,
            retry_timeout: Duration::from_secs(60),
            max_stalled_resumes: 5,
            min_rate: 32 * 1024,
            stall_window: Duration::from_secs(20),
        }
    }
}

impl RetrySettings {
    /// The configuration object_store's builders take.
    pub fn request_config(&self) -> RetryConfig {
        RetryConfig {
            backoff: self.backoff.clone(),
            max_retries: self.max_retries,
            retry_timeout: self.retry_timeout,
        }
    }

    /// Fresh state for one ranged read.
    pub fn resume_state(&self) -> ResumeState {
        ResumeState {
            settings: self.clone(),
            stalled: 0,
            last_progress: Instant::now(),
            next_backoff: self.backoff.init_backoff,
        }
    }
}

/// What a read does after a body broke off before its end, and why.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Request the rest again after waiting `wait`.
    Resume { wait: Duration, reason: String },
    /// Stop and report the failure.
    GiveUp { reason: String },
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decision::Resume { wait, reason } => write!(f, "resume in {wait:?}: {reason}"),
            Decision::GiveUp { reason } => write!(f, "give up: {reason}"),
        }
    }
}

/// The resumption state of one read (modelled on object_store's `RetryContext`): counts the
/// attempts in a row that brought no byte, knows when progress was last made, and paces
/// resumptions with exponential backoff that starts over after progress.
#[derive(Debug)]
pub struct ResumeState {
    settings: RetrySettings,
    stalled: u32,
    last_progress: Instant,
    next_backoff: Duration,
}

impl ResumeState {
    /// Records an attempt whose body broke off (`progressed`: it brought new bytes) and decides
    /// what comes next.
    pub fn after_cut(&mut self, progressed: bool) -> Decision {
        if progressed {
            self.stalled = 0;
            self.last_progress = Instant::now();
            self.next_backoff = self.settings.backoff.init_backoff;
        } else {
            self.stalled += 1;
        }
        if let Some(reason) = self.exhausted() {
            return Decision::GiveUp { reason };
        }
        let reason = if progressed {
            "the body broke off after new bytes".to_string()
        } else {
            format!(
                "{} of {} attempts in a row without progress (a new byte, at the minimum rate)",
                self.stalled, self.settings.max_stalled_resumes
            )
        };
        Decision::Resume {
            wait: self.backoff(),
            reason,
        }
    }

    /// Why resuming again is pointless, if it is: too many attempts without progress, or no
    /// progress for longer than the retry timeout.
    pub fn exhausted(&self) -> Option<String> {
        let max = self.settings.max_stalled_resumes;
        if self.stalled >= max {
            return Some(format!(
                "{max} attempts in a row made no progress (no new byte, or under the minimum rate)"
            ));
        }
        let idle = self.last_progress.elapsed();
        let limit = self.settings.retry_timeout;
        (idle > limit).then(|| format!("no progress for {idle:.1?} (limit {limit:?})"))
    }

    /// The wait before the next resumption; each call doubles (`base`) the next one, up to
    /// `max_backoff`.
    pub fn backoff(&mut self) -> Duration {
        let wait = self.next_backoff;
        let b = &self.settings.backoff;
        self.next_backoff = wait.mul_f64(b.base.max(1.0)).min(b.max_backoff);
        wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(max_stalled_resumes: u32) -> RetrySettings {
        RetrySettings {
            max_stalled_resumes,
            ..RetrySettings::default()
        }
    }

    #[test]
    fn object_store_gets_the_same_numbers() {
        let s = RetrySettings::default();
        let c = s.request_config();
        assert_eq!(c.max_retries, 6);
        assert_eq!(c.retry_timeout, Duration::from_secs(60));
        assert_eq!(c.backoff.init_backoff, Duration::from_millis(100));
        assert_eq!(c.backoff.max_backoff, Duration::from_secs(8));
        assert_eq!(c.backoff.base, 2.0);
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let mut state = RetrySettings::default().resume_state();
        let waits: Vec<u64> = (0..9).map(|_| state.backoff().as_millis() as u64).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1600, 3200, 6400, 8000, 8000]);
    }

    #[test]
    fn gives_up_after_the_stall_budget_and_says_why() {
        let mut state = settings(3).resume_state();
        let first = state.after_cut(false);
        assert_eq!(
            first,
            Decision::Resume {
                wait: Duration::from_millis(100),
                reason:
                    "1 of 3 attempts in a row without progress (a new byte, at the minimum rate)"
                        .into()
            }
        );
        assert!(
            matches!(state.after_cut(false), Decision::Resume { wait, .. } if wait == Duration::from_millis(200))
        );
        assert_eq!(
            state.after_cut(false),
            Decision::GiveUp {
                reason:
                    "3 attempts in a row made no progress (no new byte, or under the minimum rate)"
                        .into()
            }
        );
        assert!(state.exhausted().is_some());
    }

    #[test]
    fn progress_resets_the_stall_count_and_the_backoff() {
        let mut state = settings(2).resume_state();
        assert!(matches!(state.after_cut(false), Decision::Resume { .. }));
        // New bytes: the count and the wait start over, so a body that keeps breaking off
        // after progress is resumed for as long as it progresses.
        for _ in 0..10 {
            let d = state.after_cut(true);
            assert_eq!(
                d,
                Decision::Resume {
                    wait: Duration::from_millis(100),
                    reason: "the body broke off after new bytes".into()
                },
                "{d}"
            );
        }
        assert!(matches!(state.after_cut(false), Decision::Resume { .. }));
        assert!(matches!(state.after_cut(false), Decision::GiveUp { .. }));
    }

    #[test]
    fn gives_up_after_the_retry_timeout_without_progress() {
        let mut state = settings(100).resume_state();
        assert!(state.exhausted().is_none());
        // As if the last byte arrived 61 s ago (the monotonic clock starts at boot).
        let Some(then) = Instant::now().checked_sub(Duration::from_secs(61)) else {
            return;
        };
        state.last_progress = then;
        let reason = state.exhausted().expect("over the 60 s budget");
        assert!(reason.starts_with("no progress for 61"), "{reason}");
        assert!(matches!(state.after_cut(false), Decision::GiveUp { .. }));
        // Progress restarts the clock.
        assert!(matches!(state.after_cut(true), Decision::Resume { .. }));
    }
}
