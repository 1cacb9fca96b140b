//! `lattice`: puts workloads in the mesh from the command line.
//!
//! - `lattice inject -f app.yaml | kubectl apply -f -`: the mesh's additions applied to the
//!   pod template of every workload in the manifests (the same template as the admission
//!   webhook's); every other document is written out as it came.
//! - `lattice uninject -f meshed.yaml`: the additions taken out again.
//! - `lattice webhook`: the mutating admission webhook that applies the same template to pods
//!   as they are created (the injector Deployment of `deploy/`).
//!
//! A pod that is left as it was (opted out, already in the mesh, or one the mesh cannot take)
//! is reported on stderr with the reason; the command still succeeds.

use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use lattice_contract::{CapturePort, DEFAULT_TRAP_CIDR, NODE_LOCAL_DNS, TrapCidrs};
use lattice_inject::config::{ENVOY_IMAGE, IMAGE};
use lattice_inject::manifest::{self, Direction};
use lattice_inject::{InjectConfig, ProxyResources};

mod webhook;

#[derive(Parser)]
#[command(name = "lattice", version, about = "Put workloads in the Lattice mesh")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Add the mesh's init container, Envoy sidecar and DNS settings to every pod template
    /// in the manifests.
    Inject {
        #[command(flatten)]
        input: Input,
        /// The namespace of objects that name none (their pods' DNS search list depends on it).
        #[arg(short = 'n', long, default_value = "default")]
        namespace: String,
        #[command(flatten)]
        template: Box<Template>,
    },
    /// Take out what `lattice inject` (or the admission webhook) added.
    Uninject {
        #[command(flatten)]
        input: Input,
    },
    /// Serve the mutating admission webhook that injects pods as they are created.
    Webhook(Box<webhook::WebhookArgs>),
    /// Check the mesh on the cluster of the current kubeconfig: the agent, the injector, the
    /// Gateway API's CRDs, every mesh pod's Envoy. Exits 1 if a check fails.
    Check {
        /// The namespace the mesh is installed in.
        #[arg(long, default_value = "lattice-system")]
        namespace: String,
    },
}

#[derive(Args)]
struct Input {
    /// The manifests (multi-document YAML, or a List); `-` for stdin.
    #[arg(short = 'f', long = "filename", default_value = "-")]
    file: PathBuf,
}

#[derive(Args, Clone)]
pub struct Template {
    /// The image with lattice-init [default: the injector's own image (`lattice webhook`), or
    /// lattice:<this version>].
    #[arg(long, env = "LATTICE_IMAGE")]
    image: Option<String>,
    /// Envoy's image.
    #[arg(long, env = "LATTICE_ENVOY_IMAGE", default_value = ENVOY_IMAGE)]
    envoy_image: String,
    /// The trapped blocks (the agent's --trap-cidr).
    #[arg(long, default_value = DEFAULT_TRAP_CIDR)]
    trap_cidr: TrapCidrs,
    /// The capture port (the agent's --envoy-port).
    #[arg(long, default_value_t = CapturePort::default())]
    envoy_port: CapturePort,
    /// The agent's ADS address as pods dial it (host:port); lattice-init's default (the
    /// node-local address) when not given.
    #[arg(long)]
    xds_address: Option<String>,
    /// The nameserver pods ask (the agent's node-local address).
    #[arg(long, default_value_t = NODE_LOCAL_DNS)]
    nameserver: Ipv4Addr,
    /// The cluster's DNS domain.
    #[arg(long, default_value = "cluster.local")]
    cluster_domain: String,
    /// Envoy's log level.
    #[arg(long, default_value = "info")]
    proxy_log_level: String,
    /// The proxy's CPU request, memory request and memory limit, unless a pod's annotations
    /// say otherwise.
    #[arg(long, default_value = "50m")]
    proxy_cpu: String,
    #[arg(long, default_value = "64Mi")]
    proxy_memory: String,
    #[arg(long, default_value = "256Mi")]
    proxy_memory_limit: String,
}

impl Template {
    pub fn config(self) -> InjectConfig {
        InjectConfig {
            image: self.image.unwrap_or_else(|| IMAGE.to_string()),
            envoy_image: self.envoy_image,
            trap: self.trap_cidr,
            envoy_port: self.envoy_port,
            xds_address: self.xds_address,
            nameserver: self.nameserver,
            cluster_domain: self.cluster_domain,
            proxy_log_level: self.proxy_log_level,
            proxy_resources: ProxyResources {
                cpu_request: self.proxy_cpu,
                memory_request: self.proxy_memory,
                memory_limit: self.proxy_memory_limit,
            },
        }
    }
}

fn read(input: &Input) -> anyhow::Result<String> {
    if input.file.as_os_str() == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .context("reading the manifests from stdin")?;
        return Ok(text);
    }
    std::fs::read_to_string(&input.file)
        .with_context(|| format!("reading {}", input.file.display()))
}

/// `lattice check`: prints each check by section; fails if one failed.
fn check(namespace: String) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let outcomes = runtime.block_on(async {
        let client = kube::Client::try_default()
            .await
            .context("no Kubernetes client configuration (KUBECONFIG or in-cluster)")?;
        let install = lattice_inject::check::Install {
            namespace,
            ..Default::default()
        };
        anyhow::Ok(lattice_inject::check::run(&client, &install).await)
    })?;
    let mut section = "";
    let mut failed = 0;
    for outcome in &outcomes {
        if outcome.section != section {
            section = outcome.section;
            println!("\n{section}\n{}", "-".repeat(section.chars().count()));
        }
        println!("{outcome}");
        if matches!(outcome.status, lattice_inject::check::Status::Fail { .. }) {
            failed += 1;
        }
    }
    println!();
    if failed > 0 {
        anyhow::bail!("{failed} of {} checks failed", outcomes.len());
    }
    println!("Status check results are √");
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let (text, outcomes) = match cli.command {
        Command::Webhook(args) => return webhook::run(*args),
        Command::Check { namespace } => return check(namespace),
        Command::Inject {
            input,
            namespace,
            template,
        } => {
            let text = read(&input)?;
            let config = template.config();
            let direction = Direction::Inject {
                config: &config,
                namespace: &namespace,
            };
            manifest::apply(&text, direction)?
        }
        Command::Uninject { input } => manifest::apply(&read(&input)?, Direction::Uninject)?,
    };
    for outcome in &outcomes {
        if let Err(left) = &outcome.result {
            eprintln!("{}: left as it is: {left}", outcome.object);
        }
    }
    std::io::stdout()
        .write_all(text.as_bytes())
        .context("writing the manifests")?;
    Ok(())
}
