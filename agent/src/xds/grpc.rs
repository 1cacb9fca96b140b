//! The ADS gRPC service as tonic serves it. It stands in for the server that envoy-types
//! generates, for one reason: the generated one decodes state-of-the-world requests into the
//! generated `DiscoveryRequest`, a `String` per resource name, and this one decodes them into
//! [`SotwRequest`] (see [`super::wire`]). Delta requests use the generated types. The routing
//! (two method paths of `envoy.service.discovery.v3.AggregatedDiscoveryService`, anything else
//! `UNIMPLEMENTED`) and the codec defaults (no compression, tonic's message size limits) are
//! the generated server's.

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::task::{Context, Poll};

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryResponse,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::{BoxFuture, Service, StdError, http};
use tonic::server::{Grpc, NamedService, StreamingService};
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::ProstCodec;

use super::delta::DeltaStream;
use super::server::XdsServer;
use super::sotw::SotwStream;
use super::wire::SotwRequest;

const SOTW_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
const DELTA_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// `AggregatedDiscoveryService`, both methods, served by an [`XdsServer`].
#[derive(Clone)]
pub struct AdsService {
    server: XdsServer,
}

impl AdsService {
    pub fn new(server: XdsServer) -> Self {
        AdsService { server }
    }
}

impl NamedService for AdsService {
    const NAME: &'static str = "envoy.service.discovery.v3.AggregatedDiscoveryService";
}

type Opened<T> = Ready<Result<Response<ReceiverStream<Result<T, Status>>>, Status>>;

/// `StreamAggregatedResources`.
struct Sotw(XdsServer);

impl StreamingService<SotwRequest> for Sotw {
    type Response = DiscoveryResponse;
    type ResponseStream = ReceiverStream<Result<DiscoveryResponse, Status>>;
    type Future = Opened<DiscoveryResponse>;

    fn call(&mut self, request: Request<Streaming<SotwRequest>>) -> Self::Future {
        ready(Ok(Response::new(self.0.open::<SotwStream>(request))))
    }
}

/// `DeltaAggregatedResources`.
struct Delta(XdsServer);

impl StreamingService<DeltaDiscoveryRequest> for Delta {
    type Response = DeltaDiscoveryResponse;
    type ResponseStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;
    type Future = Opened<DeltaDiscoveryResponse>;

    fn call(&mut self, request: Request<Streaming<DeltaDiscoveryRequest>>) -> Self::Future {
        ready(Ok(Response::new(self.0.open::<DeltaStream>(request))))
    }
}

impl<B> Service<http::Request<B>> for AdsService
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let server = self.server.clone();
        match request.uri().path() {
            SOTW_PATH => Box::pin(async move {
                let mut grpc = Grpc::new(ProstCodec::<DiscoveryResponse, SotwRequest>::default());
                Ok(grpc.streaming(Sotw(server), request).await)
            }),
            DELTA_PATH => Box::pin(async move {
                let mut grpc = Grpc::new(
                    ProstCodec::<DeltaDiscoveryResponse, DeltaDiscoveryRequest>::default(),
                );
                Ok(grpc.streaming(Delta(server), request).await)
            }),
            _ => Box::pin(async { Ok(Status::unimplemented("").into_http()) }),
        }
    }
}
