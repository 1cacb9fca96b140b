//! Polling with a deadline: the only way a test waits for a condition (never a bare sleep).

use std::time::{Duration, Instant};

/// Polls `check` every 20 ms until it returns `Some`, or fails after `timeout` with the
/// last observation, so a failing test says what it saw.
pub fn until<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<T, String>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        match check() {
            Ok(value) => return Ok(value),
            Err(last) if Instant::now() >= deadline => {
                anyhow::bail!("timed out after {timeout:?} waiting for {what}; last seen: {last}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
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
