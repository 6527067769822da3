//! Retries, from one configuration: object_store retries each request (its `RetryConfig` is built
//! here), and a read resumes a body that broke off, asking a [`ResumeState`] whether to go on and
//! how long to wait first.

use std::fmt;
use std::time::{Duration, Instant};

use object_store::{BackoffConfig, RetryConfig};

/// How hard reads try before giving up. Storage options can override `max_retries` and
/// `retry_timeout` for the requests of one store (`split_retry_options` in object/config.rs).
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
    /// Resumptions in a row that bring no new byte, or that were cut for going too slowly,
    /// before a read gives up (each one already went through object_store's retries).
    pub max_stalled_resumes: u32,
    /// The stall rule: a body that brings fewer than `min_rate` bytes per second over a window
    /// of `min_rate_window` is cut and requested again (on a fresh connection: a cut body's
    /// connection is not reused). A trickling server, which never stops sending a byte now and
    /// then, fails after `max_stalled_resumes` such windows instead of holding a load for ever.
    pub min_rate: u64,
    pub min_rate_window: Duration,
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
            // 16 KiB/s over 20 s: a healthy connection moves megabytes per second (tens at 30 ms
            // RTT), and even a 10 Mb/s link shared by 64 reads gives each about 20 KB/s; a dead-slow
            // server fails after five windows and the backoffs between them, in about 100 s.
            min_rate: 16 << 10,
            min_rate_window: Duration::from_secs(20),
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
            slow: 0,
            window_start: Instant::now(),
            window_bytes: 0,
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
    /// Windows in a row below the minimum rate, and the current window.
    slow: u32,
    window_start: Instant,
    window_bytes: u64,
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
                "{} of {} attempts in a row without a new byte",
                self.stalled, self.settings.max_stalled_resumes
            )
        };
        Decision::Resume {
            wait: self.backoff(),
            reason,
        }
    }

    /// Counts `n` bytes that arrived, for the stall rule.
    pub fn arrived(&mut self, n: usize) {
        self.window_bytes += n as u64;
    }

    /// When the current window of the stall rule ends.
    pub fn window_end(&self) -> Instant {
        self.window_start + self.settings.min_rate_window
    }

    /// At the end of a window (the caller checks `window_end`): `None` when the window brought at
    /// least the minimum rate, else what to do with the slow body: cut it, then resume after a
    /// wait or give up. Windows span attempts (a body cut by a request timeout every few seconds
    /// is still measured over the whole window), and a slow window counts however many bytes it
    /// brought, so a trickle cannot keep a read alive; a window at the minimum rate starts the
    /// count over.
    pub fn window_passed(&mut self) -> Option<Decision> {
        let elapsed = self.window_start.elapsed();
        let rate = self.window_bytes as f64 / elapsed.as_secs_f64().max(1e-3);
        self.window_start = Instant::now();
        self.window_bytes = 0;
        if rate >= self.settings.min_rate as f64 {
            self.slow = 0;
            return None;
        }
        self.slow += 1;
        let max = self.settings.max_stalled_resumes;
        let min = rate_text(self.settings.min_rate as f64);
        if self.slow >= max {
            return Some(Decision::GiveUp {
                reason: format!(
                    "{max} windows of {:?} in a row came in below the minimum rate of {min}/s \
                     (the last at {}/s)",
                    self.settings.min_rate_window,
                    rate_text(rate)
                ),
            });
        }
        Some(Decision::Resume {
            wait: self.backoff(),
            reason: format!(
                "{}/s over {elapsed:.1?} is below the minimum rate of {min}/s ({} of {max})",
                rate_text(rate),
                self.slow
            ),
        })
    }

    /// Why resuming again is pointless, if it is: too many attempts without progress, or no
    /// progress for longer than the retry timeout.
    pub fn exhausted(&self) -> Option<String> {
        let max = self.settings.max_stalled_resumes;
        if self.stalled >= max {
            return Some(format!("{max} attempts in a row brought no new byte"));
        }
        let idle = self.last_progress.elapsed();
        let limit = self.settings.retry_timeout;
        (idle > limit).then(|| format!("no new byte for {idle:.1?} (limit {limit:?})"))
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

/// A rate for people: "12 B", "3.5 KiB", "20.0 MiB" (per second, said by the caller).
pub fn rate_text(bytes_per_s: f64) -> String {
    if bytes_per_s < 1024.0 {
        format!("{bytes_per_s:.0} B")
    } else if bytes_per_s < (1 << 20) as f64 {
        format!("{:.1} KiB", bytes_per_s / 1024.0)
    } else {
        format!("{:.1} MiB", bytes_per_s / (1 << 20) as f64)
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
                reason: "1 of 3 attempts in a row without a new byte".into()
            }
        );
        assert!(
            matches!(state.after_cut(false), Decision::Resume { wait, .. } if wait == Duration::from_millis(200))
        );
        assert_eq!(
            state.after_cut(false),
            Decision::GiveUp {
                reason: "3 attempts in a row brought no new byte".into()
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

    /// As if the current window of the stall rule started 20 s ago.
    fn back(state: &mut ResumeState) {
        if let Some(then) = Instant::now().checked_sub(Duration::from_secs(20)) {
            state.window_start = then;
        }
    }

    #[test]
    fn slow_windows_count_whatever_they_brought() {
        let mut state = settings(3).resume_state();
        // A trickle brings bytes in every window, and cuts with progress do not reset the count.
        back(&mut state);
        state.arrived(40);
        let first = state.window_passed();
        assert!(
            matches!(&first, Some(Decision::Resume { reason, .. }) if reason.starts_with("2 B/s over 20")),
            "{first:?}"
        );
        assert!(matches!(state.after_cut(true), Decision::Resume { .. }));
        back(&mut state);
        assert!(matches!(
            state.window_passed(),
            Some(Decision::Resume { .. })
        ));
        back(&mut state);
        let Some(Decision::GiveUp { reason }) = state.window_passed() else {
            panic!("a third slow window must give up");
        };
        assert_eq!(
            reason,
            "3 windows of 20s in a row came in below the minimum rate of 16.0 KiB/s (the last at 0 B/s)"
        );
    }

    #[test]
    fn a_window_at_the_minimum_rate_starts_the_count_over() {
        let mut state = settings(2).resume_state();
        back(&mut state);
        assert!(matches!(
            state.window_passed(),
            Some(Decision::Resume { .. })
        ));
        back(&mut state);
        state.arrived(20 << 20);
        assert_eq!(state.window_passed(), None);
        back(&mut state);
        assert!(matches!(
            state.window_passed(),
            Some(Decision::Resume { .. })
        ));
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
        assert!(reason.starts_with("no new byte for 61"), "{reason}");
        assert!(matches!(state.after_cut(false), Decision::GiveUp { .. }));
        // Progress restarts the clock.
        assert!(matches!(state.after_cut(true), Decision::Resume { .. }));
    }
}
