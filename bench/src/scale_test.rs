//! Running one of the ignored scale tests of `tests/` as a benchmark: build the agent (release,
//! or debug for a smoke run), run the test against it, and read the JSON report it prints
//! after a marker.

use anyhow::{Context, bail};

pub struct ScaleTest<'a> {
    /// The integration test file of `lattice-e2e` (`kube`, `xds_scale`).
    pub file: &'a str,
    /// The ignored test's name.
    pub test: &'a str,
    /// The prefix of the line that carries the JSON report.
    pub marker: &'a str,
}

impl ScaleTest<'_> {
    pub fn run(
        &self,
        smoke: bool,
        envs: impl IntoIterator<Item = (String, String)>,
    ) -> anyhow::Result<serde_json::Value> {
        let profile: &[&str] = if smoke { &[] } else { &["--release"] };
        // The same build as `cargo xtask test`'s (debug) or as every release measurement's,
        // whose features are the tests' own: the test below compiles nothing more.
        xtask::run(xtask::cargo().args(if smoke {
            xtask::DEBUG_BUILD
        } else {
            xtask::RELEASE_BUILD
        }))?;
        // `cargo test --release` runs from target/release, so the test finds the release agent.
        let output = xtask::cargo()
            .args(["test", "--workspace", "--test", self.file])
            .args(profile)
            .args(["--", "--ignored", "--exact", "--nocapture", self.test])
            .envs(envs)
            .output()
            .with_context(|| format!("running the scale test {}", self.test))?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() {
            bail!(
                "the scale test {} failed ({}):\n{stdout}\n{}",
                self.test,
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let line = stdout
            .lines()
            .find_map(|l| l.strip_prefix(self.marker))
            .with_context(|| {
                format!("{} printed no {:?} line:\n{stdout}", self.test, self.marker)
            })?;
        let mut report: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("the report of {} is not JSON: {line}", self.test))?;
        report["build"] = if smoke { "debug" } else { "release" }.into();
        Ok(report)
    }
}

/// Sizes as environment variables for a scale test: `(variable, smoke, full)` each; a
/// variable already set in the environment wins, so a shorter run at full size is one
/// variable away.
pub fn sizes(smoke: bool, sizes: &[(&str, &str, &str)]) -> Vec<(String, String)> {
    sizes
        .iter()
        .map(|(name, small, full)| {
            let default = if smoke { small } else { full };
            (
                name.to_string(),
                std::env::var(name).unwrap_or_else(|_| default.to_string()),
            )
        })
        .collect()
}
