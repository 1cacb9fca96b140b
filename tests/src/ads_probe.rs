//! One Delta ADS request from inside a network namespace, and the agent's first answer: how
//! tests ask the agent something as a given pod would (its address, its node id).

use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse,
};
use tonic::Status;

use crate::netns::Netns;

/// Opens a Delta stream from inside `netns` to `xds`, sends `request`, and returns the
/// agent's first response (within 5 s), or the status that ended the stream.
pub fn first_delta_answer(
    netns: &Netns,
    xds: SocketAddr,
    request: DeltaDiscoveryRequest,
) -> Result<DeltaDiscoveryResponse, Status> {
    netns
        .enter(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| Status::internal(e.to_string()))?;
            runtime.block_on(async move {
                let channel = tonic::transport::Endpoint::from_shared(format!("http://{xds}"))
                    .map_err(|e| Status::internal(e.to_string()))?
                    .connect_timeout(Duration::from_secs(2))
                    .connect()
                    .await
                    .map_err(|e| Status::unavailable(format!("connect: {e}")))?;
                let mut client = AggregatedDiscoveryServiceClient::new(channel);
                let (tx, rx) = tokio::sync::mpsc::channel(1);
                tx.send(request)
                    .await
                    .map_err(|e| Status::internal(e.to_string()))?;
                let mut stream = client
                    .delta_aggregated_resources(tokio_stream::wrappers::ReceiverStream::new(rx))
                    .await?
                    .into_inner();
                let answer = tokio::time::timeout(Duration::from_secs(5), stream.message()).await;
                drop(tx);
                match answer {
                    Ok(Ok(Some(response))) => Ok(response),
                    Ok(Ok(None)) => Err(Status::unknown("stream closed without an answer")),
                    Ok(Err(status)) => Err(status),
                    Err(_) => Err(Status::deadline_exceeded("no answer in 5 s")),
                }
            })
        })
        .unwrap_or_else(|e| Err(Status::internal(e.to_string())))
}
