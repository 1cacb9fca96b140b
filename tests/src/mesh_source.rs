//! Where the agent under test reads its mesh: a mesh file, or the fake API server through the
//! agent's real kube client. Tests that prove a feature for both sources build one of each and
//! write the same scenario in either's terms.

use crate::agent::Agent;
use crate::fake_apiserver::FakeApiServer;
use crate::node::{MeshFile, Node};

pub enum MeshSource {
    File(MeshFile),
    Kube {
        server: FakeApiServer,
        kubeconfig: String,
        _dir: tempfile::TempDir,
    },
}

impl MeshSource {
    /// An empty mesh file, or the fake API server in the node's namespace (where the agent
    /// runs) with a kubeconfig for it.
    pub fn start(node: &Node, kubernetes: bool) -> anyhow::Result<MeshSource> {
        if !kubernetes {
            return Ok(MeshSource::File(MeshFile::new(&[])?));
        }
        let server = node.netns.enter(FakeApiServer::start)??;
        let (dir, kubeconfig) = server.kubeconfig_file()?;
        Ok(MeshSource::Kube {
            server,
            kubeconfig,
            _dir: dir,
        })
    }

    /// The agent in the node, reading this source, once it is ready.
    pub fn agent(&self, node: &Node) -> anyhow::Result<Agent> {
        self.agent_with(node, &[])
    }

    /// [`MeshSource::agent`] with more arguments.
    pub fn agent_with(&self, node: &Node, args: &[&str]) -> anyhow::Result<Agent> {
        match self {
            MeshSource::File(file) => {
                let path = file.path().to_string_lossy();
                let mut all = vec!["--mesh-file", &path];
                all.extend(args);
                node.agent(&all, &[])
            }
            MeshSource::Kube { kubeconfig, .. } => node.agent(args, &[("KUBECONFIG", kubeconfig)]),
        }
    }
}
