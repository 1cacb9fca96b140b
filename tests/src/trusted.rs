//! A node whose agent serves workload certificates, as the DaemonSet runs it: the node-local
//! address, `NODE_NAME=node-a`, Kubernetes from the fake API server holding this node's Pods
//! and the CA's Secret, and optionally a mesh file beside it. Shared by the mutual-TLS tests
//! and their benchmark.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use k8s_openapi::ByteString;
use lattice_inject::certs::Chain;
use serde_json::{Value, json};

use crate::agent::{Agent, AgentAddrs};
use crate::fake_apiserver::FakeApiServer;
use crate::node::{ADMIN, ClientPod, MeshFile, Node};

/// The node-local address the agent serves DNS and xDS on.
pub const NODE_LOCAL: Ipv4Addr = Ipv4Addr::new(169, 254, 20, 10);
pub const XDS: SocketAddr = SocketAddr::new(IpAddr::V4(NODE_LOCAL), 15010);
pub const DNS: SocketAddr = SocketAddr::new(IpAddr::V4(NODE_LOCAL), 53);

/// A running Pod of node-a in namespace `default`, with `annotations`.
pub fn pod(name: &str, account: &str, ip: Ipv4Addr, annotations: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"namespace": "default", "name": name, "annotations": annotations},
           "spec": {"nodeName": "node-a", "serviceAccountName": account,
                    "containers": [{"name": "app", "image": "app"}]},
           "status": {"phase": "Running", "podIP": ip.to_string(),
                      "podIPs": [{"ip": ip.to_string()}]}})
}

/// The CA's Secret (`lattice-system/lattice-ca`) with `issuer` signing and `roots` trusted.
pub fn ca_secret(issuer: &Chain, roots: &[&Chain]) -> Value {
    let bytes = |text: &str| json!(ByteString(text.as_bytes().to_vec()));
    let bundle: String = roots.iter().map(|c| c.ca_cert.as_str()).collect();
    json!({
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
        "metadata": {"name": "lattice-ca", "namespace": "lattice-system"},
        "data": {"tls.crt": bytes(&issuer.ca_cert), "tls.key": bytes(&issuer.ca_key),
                 "ca.crt": bytes(&bundle)}
    })
}

/// The node, its fake API server, the CA, the agent, and the mesh file if one was given.
pub struct TrustedNode {
    pub node: Node,
    pub server: FakeApiServer,
    pub chain: Chain,
    pub agent: Agent,
    pub mesh: Option<MeshFile>,
    _kubeconfig: tempfile::TempDir,
    /// `--state-dir`, as the DaemonSet gives it: pods' scopes outlive a restart.
    _state: tempfile::TempDir,
}

impl TrustedNode {
    /// Starts the agent once the API server holds the CA's Secret and `objects`, with a mesh
    /// file of `mesh` (YAML) when given.
    pub fn start(label: &str, objects: Vec<Value>, mesh: Option<&str>) -> anyhow::Result<Self> {
        Self::start_with(label, objects, mesh, true)
    }

    /// As [`TrustedNode::start`], but the CA's Secret is not in the API server (`chain` is
    /// the CA a test may put there later, with [`ca_secret`]).
    pub fn start_without_ca(label: &str, objects: Vec<Value>) -> anyhow::Result<Self> {
        Self::start_with(label, objects, None, false)
    }

    fn start_with(
        label: &str,
        objects: Vec<Value>,
        mesh: Option<&str>,
        with_ca: bool,
    ) -> anyhow::Result<Self> {
        let node = Node::new(label)?;
        let server = node.netns.enter(FakeApiServer::start)??;
        let chain = Chain::issue(&["unused.example".to_string()])?;
        if with_ca {
            server.apply_json(ca_secret(&chain, &[&chain]))?;
        }
        for object in objects {
            server.apply_json(object)?;
        }
        let (dir, kubeconfig) = server.kubeconfig_file()?;
        let local = NODE_LOCAL.to_string();
        let state = tempfile::tempdir()?;
        let mut args = vec![
            "--node-local-dns".to_string(),
            local,
            "--state-dir".to_string(),
            state.path().display().to_string(),
        ];
        let mesh = match mesh {
            Some(text) => {
                let file = MeshFile::new(&[])?;
                file.write_text(text)?;
                args.extend([
                    "--kubernetes".to_string(),
                    "--mesh-file".to_string(),
                    file.path().display().to_string(),
                ]);
                Some(file)
            }
            None => None,
        };
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let agent = node.agent_at(
            AgentAddrs {
                xds: XDS,
                dns: DNS,
                admin: ADMIN,
            },
            &args,
            &[("KUBECONFIG", kubeconfig.as_str()), ("NODE_NAME", "node-a")],
        )?;
        Ok(TrustedNode {
            node,
            server,
            chain,
            agent,
            mesh,
            _kubeconfig: dir,
            _state: state,
        })
    }

    /// A mesh pod of this node at `10.200.0.<host>`, whose Envoy uses the agent's node-local
    /// address, with more `lattice-init` flags.
    pub fn pod(&self, label: &str, host: u8, init_args: &[&str]) -> anyhow::Result<ClientPod> {
        self.node.client_with(label, host, (XDS, DNS), init_args)
    }
}

/// Whether `pod`'s Envoy has its inbound listener.
pub fn inbound_listening(pod: &ClientPod) -> Result<(), String> {
    let listeners = pod.envoy_admin("/listeners")?;
    if listeners.contains("lattice-inbound::0.0.0.0:15006") {
        Ok(())
    } else {
        Err(format!("no inbound listener yet: {listeners}"))
    }
}

/// Runs `openssl args` in `netns` with `stdin` (at most 10 s); its stdout, or why it failed.
pub fn openssl(netns: &crate::netns::Netns, args: &[&str], stdin: &str) -> Result<String, String> {
    use std::io::Write as _;
    let mut child = netns
        .command("timeout")
        .arg("10")
        .arg("openssl")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .map_err(|e| e.to_string())?;
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!(
            "openssl {args:?}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}
