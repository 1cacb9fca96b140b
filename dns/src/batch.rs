//! Datagrams in batches: up to [`BATCH`] queries from one `recvmmsg`, and the replies the fast
//! path wrote to them in one `sendmmsg`. A profile of the server at saturation had 88 % of its
//! CPU in the kernel, a `recvfrom` and a `sendto` per query (docs/benchmarks.md, DNS): one
//! system call per burst instead of two per query. Knot's UDP workers batch the same way.
//!
//! nix's `recvmmsg`/`sendmmsg` rather than hand-written `libc` calls: the project's chosen
//! crate for system calls, with safe wrappers over both.

use std::io::{self, IoSlice, IoSliceMut};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;

use nix::sys::socket::{MsgFlags, MultiHeaders, SockaddrStorage, recvmmsg, sendmmsg};
use tokio::io::Interest;
use tokio::net::UdpSocket;

use crate::wire::MAX_UDP_PAYLOAD;

/// Datagrams taken or sent per system call.
pub(crate) const BATCH: usize = 32;

/// The largest query kept: a query is a question and an OPT record, far below this; a longer
/// datagram arrives truncated and is dropped.
const QUERY_MAX: usize = 4096;

/// Queries received by one `recvmmsg`. (nix's `MultiHeaders` holds raw pointers, so it is
/// not `Send`: made per call, a few KiB, rather than kept across the task's awaits.)
pub(crate) struct Inbox {
    buffers: Vec<u8>,
    received: Vec<(usize, Option<SocketAddr>)>,
}

impl Inbox {
    pub(crate) fn new() -> Self {
        Inbox {
            buffers: vec![0; BATCH * QUERY_MAX],
            received: Vec::with_capacity(BATCH),
        }
    }

    /// Takes what the socket holds, up to [`BATCH`] datagrams; how many (0: none waiting).
    /// Truncated datagrams count, but are not kept (see [`Inbox::query`]).
    pub(crate) fn receive(&mut self, socket: &UdpSocket) -> io::Result<usize> {
        self.received.clear();
        let (buffers, received) = (&mut self.buffers, &mut self.received);
        let mut headers = MultiHeaders::<SockaddrStorage>::preallocate(BATCH, None);
        let result = socket.try_io(Interest::READABLE, || {
            let mut slices: Vec<[IoSliceMut<'_>; 1]> = buffers
                .chunks_exact_mut(QUERY_MAX)
                .map(|buffer| [IoSliceMut::new(buffer)])
                .collect();
            let messages = recvmmsg(
                socket.as_raw_fd(),
                &mut headers,
                slices.iter_mut(),
                MsgFlags::MSG_DONTWAIT,
                None,
            )
            .map_err(io::Error::from)?;
            for message in messages {
                let peer = match message.flags.contains(MsgFlags::MSG_TRUNC) {
                    true => None,
                    false => message.address.as_ref().and_then(socket_addr),
                };
                received.push((message.bytes, peer));
            }
            Ok(())
        });
        match result {
            Ok(()) => Ok(self.received.len()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
            Err(e) => Err(e),
        }
    }

    /// The `i`-th datagram of the last receive and who sent it; `None` for one not kept (too
    /// long for a query).
    pub(crate) fn query(&self, i: usize) -> Option<(&[u8], SocketAddr)> {
        let (len, peer) = self.received[i];
        Some((&self.buffers[i * QUERY_MAX..i * QUERY_MAX + len], peer?))
    }
}

/// Replies written in place, sent together by [`Outbox::flush`].
pub(crate) struct Outbox {
    buffers: Vec<u8>,
    lens: Vec<usize>,
    peers: Vec<Option<SockaddrStorage>>,
}

impl Outbox {
    const SLOT: usize = MAX_UDP_PAYLOAD as usize;

    pub(crate) fn new() -> Self {
        Outbox {
            buffers: vec![0; BATCH * Self::SLOT],
            lens: Vec::with_capacity(BATCH),
            peers: Vec::with_capacity(BATCH),
        }
    }

    /// Where the next reply is written (a reply of the fast path fits: it is at most
    /// [`MAX_UDP_PAYLOAD`] bytes). One slot per query of an [`Inbox`]: flush after each.
    pub(crate) fn slot(&mut self) -> &mut [u8] {
        let at = self.lens.len() * Self::SLOT;
        &mut self.buffers[at..at + Self::SLOT]
    }

    /// The reply just written to [`Outbox::slot`], `len` bytes, goes to `peer`.
    pub(crate) fn push(&mut self, len: usize, peer: SocketAddr) {
        self.lens.push(len);
        self.peers.push(Some(SockaddrStorage::from(peer)));
    }

    /// Sends every reply written, best effort as a single `sendto` was: what the socket does
    /// not take now (a full send buffer) is dropped and the client retries. Returns how many
    /// replies were not sent.
    pub(crate) fn flush(&mut self, socket: &UdpSocket) -> usize {
        let total = self.lens.len();
        if total == 0 {
            return 0;
        }
        let mut headers = MultiHeaders::<SockaddrStorage>::preallocate(BATCH, None);
        let mut sent = 0;
        while sent < total {
            let slices: Vec<[IoSlice<'_>; 1]> = self.lens[sent..]
                .iter()
                .enumerate()
                .map(|(i, len)| {
                    let at = (sent + i) * Self::SLOT;
                    [IoSlice::new(&self.buffers[at..at + len])]
                })
                .collect();
            let peers = &self.peers[sent..];
            let result = socket.try_io(Interest::WRITABLE, || {
                sendmmsg(
                    socket.as_raw_fd(),
                    &mut headers,
                    slices.iter(),
                    peers,
                    [],
                    MsgFlags::MSG_DONTWAIT,
                )
                .map(|results| results.count())
                .map_err(io::Error::from)
            });
            match result {
                Ok(n) if n > 0 => sent += n,
                Ok(_) => break,
                Err(e) => {
                    // The first reply of the rest failed (its client's ICMP error, or a full
                    // buffer): drop it and go on with the others.
                    tracing::debug!(error = %e, "cannot send a DNS reply");
                    sent += 1;
                }
            }
        }
        self.lens.clear();
        self.peers.clear();
        total - sent
    }
}

fn socket_addr(address: &SockaddrStorage) -> Option<SocketAddr> {
    if let Some(v4) = address.as_sockaddr_in() {
        return Some(SocketAddr::V4((*v4).into()));
    }
    address
        .as_sockaddr_in6()
        .map(|v6| SocketAddr::V6((*v6).into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Datagrams sent one by one come out of one receive, each with its sender, and replies
    /// written in place reach each sender.
    #[tokio::test]
    async fn receives_a_burst_at_once_and_sends_each_reply_to_its_peer() {
        let server = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = server.local_addr().unwrap();
        let clients = [
            UdpSocket::bind("127.0.0.1:0").await.unwrap(),
            UdpSocket::bind("127.0.0.1:0").await.unwrap(),
        ];
        for i in 0..10u8 {
            clients[usize::from(i % 2)]
                .send_to(&[i; 12], addr)
                .await
                .unwrap();
        }
        let mut inbox = Inbox::new();
        let mut outbox = Outbox::new();
        let mut got = Vec::new();
        while got.len() < 10 {
            server.readable().await.unwrap();
            let n = inbox.receive(&server).unwrap();
            for i in 0..n {
                let (query, peer) = inbox.query(i).unwrap();
                got.push((query.to_vec(), peer));
                let slot = outbox.slot();
                slot[..3].copy_from_slice(&[query[0], 0xaa, 0xbb]);
                outbox.push(3, peer);
            }
            assert_eq!(outbox.flush(&server), 0);
        }
        for (i, (query, peer)) in got.iter().enumerate() {
            assert_eq!(query, &vec![i as u8; 12]);
            assert_eq!(*peer, clients[i % 2].local_addr().unwrap());
        }
        let mut buf = [0u8; 16];
        for i in 0..10u8 {
            let n = clients[usize::from(i % 2)].recv(&mut buf).await.unwrap();
            assert_eq!(&buf[..n], &[i, 0xaa, 0xbb]);
        }
    }

    #[tokio::test]
    async fn a_datagram_longer_than_a_query_is_dropped() {
        let server = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        client
            .send_to(&vec![7u8; QUERY_MAX + 1], server.local_addr().unwrap())
            .await
            .unwrap();
        client
            .send_to(&[1, 2, 3], server.local_addr().unwrap())
            .await
            .unwrap();
        let mut inbox = Inbox::new();
        let mut got = Vec::new();
        while got.len() < 2 {
            server.readable().await.unwrap();
            let n = inbox.receive(&server).unwrap();
            got.extend((0..n).map(|i| inbox.query(i).map(|(q, _)| q.to_vec())));
        }
        assert_eq!(got, [None, Some(vec![1, 2, 3])], "the long one not kept");
    }
}
