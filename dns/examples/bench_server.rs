//! Benchmark server for `cargo xtask bench` (xtask/src/bench_dns.rs): the lattice DNS server on
//! one thread with one UDP socket, serving the generated mesh of `bench_names(N)`, forwarding the
//! rest to `--upstream`. Prints `listening on ADDR` when ready.
//!
//! `bench_server --listen 127.0.0.1:15053 --names 1000 --upstream 127.0.0.1:15054`
//! Mesh name i is `svc<i>.ns<i % 10>.system.internal` → 240.240.<i / 250>.<i % 250 + 1>.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use lattice_dns::{DnsConfig, DnsMetrics, DnsServer, NameTable};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut listen: SocketAddr = "127.0.0.1:15053".parse()?;
    let mut names = 1000u32;
    let mut upstreams = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--listen" => listen = value.parse()?,
            "--names" => names = value.parse()?,
            "--upstream" => upstreams.push(value.parse()?),
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    let table = NameTable::new((0..names).map(|i| {
        let addr = Ipv4Addr::new(240, 240, (i / 250) as u8, (i % 250 + 1) as u8);
        (
            format!("svc{i}.ns{}.system.internal", i % 10),
            IpAddr::V4(addr),
        )
    }));
    let mut config = DnsConfig::new(listen, upstreams);
    config.udp_sockets = 1;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let mut registry = Registry::default();
        let metrics = DnsMetrics::new(&mut registry);
        let (_names, rx) = tokio::sync::watch::channel(Arc::new(table));
        let server = DnsServer::bind(config, rx, metrics).await?;
        println!("listening on {}", server.local_addr());
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        tokio::spawn(async move {
            let _ = tokio::signal::ctrl_c().await;
            token.cancel();
        });
        server.run(shutdown).await?;
        Ok(())
    })
}
