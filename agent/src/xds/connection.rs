//! The xDS server's connections, read ahead. h2 reads its socket into a buffer sized to the
//! frame it is reading, about 8 KiB at a time: a SotW endpoint ACK of 400 KB (10k names at 10k
//! services) took about fifty `recv` calls, and at 50 SotW proxies a change cost the agent
//! 2400 of them (`strace -c` on the agent during the change phase: 95,870 `recvfrom` in 3 s,
//! the most frequent call by far). Each connection now reads through a 64 KiB buffer, so one
//! call takes what the socket holds, up to 64 KiB: one copy more in user space, far fewer
//! calls into the kernel.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, BufReader, ReadBuf};
use tokio::net::TcpStream;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// A proxy's connection: reads through a buffer, writes straight through.
pub struct ReadAhead(BufReader<TcpStream>);

impl ReadAhead {
    /// What one read of the socket may take.
    pub const BUFFER: usize = 64 << 10;

    pub fn new(stream: TcpStream) -> Self {
        ReadAhead(BufReader::with_capacity(Self::BUFFER, stream))
    }
}

/// The `accepted` connections (from the agent's listeners, `lattice_dns::handoff::incoming`),
/// without Nagle's delay (a small push, one endpoint change, would otherwise wait for the
/// proxy's delayed ACK of the previous segment, tens of milliseconds).
pub fn incoming(
    accepted: impl Stream<Item = io::Result<TcpStream>>,
) -> impl Stream<Item = io::Result<ReadAhead>> {
    accepted.map(|accepted| {
        let stream = accepted?;
        stream.set_nodelay(true)?;
        Ok(ReadAhead::new(stream))
    })
}

impl AsyncRead for ReadAhead {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for ReadAhead {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// The peer's address, as tonic gives it for a plain TCP stream (the identity check reads it).
impl Connected for ReadAhead {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.0.get_ref().connect_info()
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn reads_through_its_buffer_and_writes_straight_through() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut accepted = Box::pin(incoming(tokio_stream::wrappers::TcpListenerStream::new(
            listener,
        )));
        let mut client = TcpStream::connect(addr).await.unwrap();
        let mut server = accepted.next().await.unwrap().unwrap();
        assert_eq!(
            server.connect_info().remote_addr,
            Some(client.local_addr().unwrap())
        );

        let sent: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        client.write_all(&sent).await.unwrap();
        client.shutdown().await.unwrap();
        let mut got = Vec::new();
        let mut small = [0u8; 8192];
        loop {
            let n = server.read(&mut small).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&small[..n]);
        }
        assert_eq!(got, sent);

        server.write_all(b"answer").await.unwrap();
        server.flush().await.unwrap();
        let mut answer = [0u8; 6];
        client.read_exact(&mut answer).await.unwrap();
        assert_eq!(&answer, b"answer");
    }
}
