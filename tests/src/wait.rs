//! Polling with a deadline: the only way a test waits for a condition (never a bare sleep).

use std::time::{Duration, Instant};

/// Polls `check` every 20 ms until it returns `Some`, or fails after `timeout` with the
/// last observation, so a failing test says what it saw.
pub fn until<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<T, String>,
) -> anyhow::Result<T> {
    until_or_stop(what, timeout, || check().map_err(Poll::Again))
}

/// What a check of [`until_or_stop`] saw when its condition did not hold yet.
pub enum Poll {
    /// It may still hold: poll again.
    Again(String),
    /// It never will (the process it waits on has exited): fail now, not at the deadline.
    Never(String),
}

/// [`until`], for a condition that a check can see will never hold.
pub fn until_or_stop<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<T, Poll>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        match check() {
            Ok(value) => return Ok(value),
            Err(Poll::Never(last)) => anyhow::bail!("gave up waiting for {what}: {last}"),
            Err(Poll::Again(last)) if Instant::now() >= deadline => {
                anyhow::bail!("timed out after {timeout:?} waiting for {what}; last seen: {last}")
            }
            Err(Poll::Again(_)) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Async variant of [`until`].
pub async fn until_async<T, F, Fut>(
    what: &str,
    timeout: Duration,
    mut check: F,
) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        match check().await {
            Ok(value) => return Ok(value),
            Err(last) if Instant::now() >= deadline => {
                anyhow::bail!("timed out after {timeout:?} waiting for {what}; last seen: {last}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}
