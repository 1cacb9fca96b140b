//! The `lattice-init` binary: parse flags, set up logging, run, map the outcome to an exit code.

use std::io::IsTerminal as _;
use std::process::ExitCode;

use clap::Parser as _;
use lattice_init::InitError;
use lattice_init::config::{Args, InitConfig};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    // Flag syntax errors exit 2 here, before anything else runs.
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let code = err
                .downcast_ref::<InitError>()
                .map_or(1, InitError::exit_code);
            // Every error message already carries its cause.
            tracing::error!("{err}");
            ExitCode::from(code)
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let config =
        InitConfig::from_args(args, |name| std::env::var(name).ok()).map_err(InitError::from)?;
    lattice_init::run(&config, &mut std::io::stdout().lock())?;
    Ok(())
}
