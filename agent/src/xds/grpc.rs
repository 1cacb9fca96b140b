//! The ADS gRPC service as tonic serves it. It stands in for the server that envoy-types
//! generates, for one reason: the generated one decodes state-of-the-world requests into the
//! generated `DiscoveryRequest`, a `String` per resource name, and this one decodes them into
//! [`super::wire::SotwRequest`]. Delta requests use the generated types. The routing
//! (two method paths of `envoy.service.discovery.v3.AggregatedDiscoveryService`, anything else
//! `UNIMPLEMENTED`) and the codec defaults (no compression, tonic's message size limits) are
//! the generated server's.

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::marker::PhantomData;
use std::task::{Context, Poll};

use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::{BoxFuture, Service, StdError, http};
use tonic::server::{Grpc, NamedService, StreamingService};
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::ProstCodec;

use super::delta::DeltaStream;
use super::server::XdsServer;
use super::sotw::SotwStream;
use super::stream::Ads;

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

/// One of the two methods, opened as a stream of the [`Ads`] machine `A`.
struct Open<A>(XdsServer, PhantomData<fn() -> A>);

impl<A: Ads> StreamingService<A::Request> for Open<A> {
    type Response = A::Response;
    type ResponseStream = ReceiverStream<Result<A::Response, Status>>;
    type Future = Ready<Result<Response<Self::ResponseStream>, Status>>;

    fn call(&mut self, request: Request<Streaming<A::Request>>) -> Self::Future {
        ready(Ok(Response::new(self.0.open::<A>(request))))
    }
}

/// Serves one call of a method as a stream of `A`, with the generated server's codec defaults.
fn serve<A: Ads, B>(
    server: XdsServer,
    request: http::Request<B>,
) -> BoxFuture<http::Response<tonic::body::Body>, Infallible>
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    Box::pin(async move {
        let mut grpc = Grpc::new(ProstCodec::<A::Response, A::Request>::default());
        Ok(grpc
            .streaming(Open::<A>(server, PhantomData), request)
            .await)
    })
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
            SOTW_PATH => serve::<SotwStream, B>(server, request),
            DELTA_PATH => serve::<DeltaStream, B>(server, request),
            _ => Box::pin(async { Ok(Status::unimplemented("").into_http()) }),
        }
    }
}
