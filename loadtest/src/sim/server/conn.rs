//! Connection I/O: a reader that notices disconnects while a response is pending, request
//! head and body framing, and the keep-alive loop of one connection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::rc::Rc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use monoio::io::{AsyncReadRent, AsyncWriteRentExt, OwnedReadHalf, OwnedWriteHalf, Splitable};
use monoio::net::TcpStream;
use radixgate::http::response::CONTINUE_100;
use radixgate::http::{parse_request_head, BodyFraming, ChunkedDecoder, HeadLimits, RequestHead};

use crate::sim::engine::ReqId;

use super::routes::{handle, respond_error};
use super::Server;

/// Idle keep-alive timeout between requests (uvicorn's default).
const IDLE_TIMEOUT: Duration = Duration::from_secs(5);
/// Timeout for the rest of a request once its first byte arrived.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest request body accepted.
const MAX_BODY: u64 = 64 * 1024 * 1024;
/// Bytes buffered from a client while its response is pending before we stop reading.
const MAX_PIPELINED: usize = 1024 * 1024;

type ReadHalf = OwnedReadHalf<TcpStream>;
pub(super) type WriteHalf = OwnedWriteHalf<TcpStream>;
type PendingRead = Pin<Box<dyn Future<Output = (io::Result<usize>, Vec<u8>, ReadHalf)>>>;

/// The read side of a connection. A read, once started, stays pending (owned by `pending`)
/// until it completes, even if the future awaiting it is dropped: no received byte is lost when
/// a wait for request events wins a race against the socket.
pub(super) struct Reader {
    rd: Option<ReadHalf>,
    pending: Option<PendingRead>,
    spare: Vec<u8>,
    buf: BytesMut,
    eof: bool,
}

impl Reader {
    fn new(rd: ReadHalf) -> Self {
        Reader {
            rd: Some(rd),
            pending: None,
            spare: Vec::with_capacity(16 * 1024),
            buf: BytesMut::new(),
            eof: false,
        }
    }

    /// Read more bytes into `buf`. `Ok(0)` means the peer closed (or half-closed) its side.
    async fn fill(&mut self) -> io::Result<usize> {
        if self.eof {
            return Ok(0);
        }
        if self.pending.is_none() {
            let Some(mut rd) = self.rd.take() else {
                return Ok(0);
            };
            let mut b = std::mem::take(&mut self.spare);
            b.clear();
            if b.capacity() < 16 * 1024 {
                b.reserve(16 * 1024);
            }
            self.pending = Some(Box::pin(async move {
                let (r, b) = rd.read(b).await;
                (r, b, rd)
            }));
        }
        let Some(fut) = self.pending.as_mut() else {
            return Ok(0);
        };
        let (r, b, rd) = fut.await;
        self.pending = None;
        self.rd = Some(rd);
        let n = match r {
            Ok(n) => n,
            Err(e) => {
                self.spare = b;
                self.eof = true;
                return Err(e);
            }
        };
        self.buf.extend_from_slice(&b[..n]);
        self.spare = b;
        if n == 0 {
            self.eof = true;
        }
        Ok(n)
    }

    /// Resolves when the client disconnects (EOF or error); bytes it sends meanwhile
    /// (pipelined requests) are buffered, up to a cap after which we stop reading.
    pub(super) async fn disconnected(&mut self) {
        loop {
            if self.buf.len() > MAX_PIPELINED {
                std::future::pending::<()>().await;
            }
            match self.fill().await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    }
}

pub(super) async fn write(wr: &mut WriteHalf, data: Bytes) -> io::Result<()> {
    let (r, _) = wr.write_all(data).await;
    r.map(|_| ())
}

/// Aborts the requests of a response task that ends early (disconnect, write error, fault,
/// shutdown): whatever path leaves the handler, no request outlives its client.
pub(super) struct AbortGuard {
    pub(super) sh: Rc<Server>,
    pub(super) ids: Vec<ReqId>,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        for &id in &self.ids {
            self.sh.abort(id);
        }
    }
}

pub(super) enum Next {
    KeepAlive,
    Close,
}

enum HeadRead {
    Head(Box<RequestHead>),
    Closed,
    Error(u16, &'static str),
}

async fn read_head(sh: &Server, r: &mut Reader) -> HeadRead {
    let limits = HeadLimits::default();
    loop {
        match parse_request_head(&mut r.buf, &limits) {
            Ok(Some(h)) => return HeadRead::Head(Box::new(h)),
            Ok(None) => {}
            Err(e) => return HeadRead::Error(e.status(), e.message()),
        }
        let limit = if r.buf.is_empty() {
            IDLE_TIMEOUT
        } else {
            REQUEST_TIMEOUT
        };
        monoio::select! {
            res = monoio::time::timeout(limit, r.fill()) => match res {
                Ok(Ok(n)) if n > 0 => {}
                _ => return HeadRead::Closed,
            },
            _ = sh.shutdown.wait() => return HeadRead::Closed,
        }
    }
}

async fn read_body(
    sh: &Server,
    head: &RequestHead,
    r: &mut Reader,
) -> Result<Bytes, Option<(u16, &'static str)>> {
    match head.framing {
        BodyFraming::None | BodyFraming::Close => Ok(Bytes::new()),
        BodyFraming::Length(n) => {
            if n > MAX_BODY {
                return Err(Some((413, "request body too large")));
            }
            let n = n as usize;
            while r.buf.len() < n {
                fill_or_stop(sh, r).await?;
            }
            Ok(r.buf.split_to(n).freeze())
        }
        BodyFraming::Chunked => {
            let mut dec = ChunkedDecoder::new(MAX_BODY);
            let mut body = BytesMut::new();
            loop {
                let used = dec
                    .feed(&r.buf, &mut body)
                    .map_err(|e| Some((e.status(), e.message())))?;
                let _ = r.buf.split_to(used);
                if dec.is_done() {
                    return Ok(body.freeze());
                }
                fill_or_stop(sh, r).await?;
            }
        }
    }
}

async fn fill_or_stop(sh: &Server, r: &mut Reader) -> Result<(), Option<(u16, &'static str)>> {
    monoio::select! {
        res = monoio::time::timeout(REQUEST_TIMEOUT, r.fill()) => match res {
            Ok(Ok(n)) if n > 0 => Ok(()),
            _ => Err(None),
        },
        _ = sh.shutdown.wait() => Err(None),
    }
}

pub(super) async fn connection(sh: Rc<Server>, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let (rd, mut wr) = stream.into_split();
    let mut reader = Reader::new(rd);
    sh.connections.set(sh.connections.get() + 1);
    let mut carried_inference = false;
    loop {
        let head = match read_head(&sh, &mut reader).await {
            HeadRead::Head(h) => h,
            HeadRead::Closed => return,
            HeadRead::Error(status, msg) => {
                respond_error(&sh, &mut wr, false, status, "BadRequestError", msg).await;
                return;
            }
        };
        if head.expect_continue
            && !matches!(head.framing, BodyFraming::None)
            && write(&mut wr, Bytes::from_static(CONTINUE_100))
                .await
                .is_err()
        {
            return;
        }
        let body = match read_body(&sh, &head, &mut reader).await {
            Ok(b) => b,
            Err(Some((status, msg))) => {
                respond_error(&sh, &mut wr, false, status, "BadRequestError", msg).await;
                return;
            }
            Err(None) => return,
        };
        sh.record(&head, &body);
        if !carried_inference
            && matches!(
                head.path(),
                b"/generate" | b"/v1/chat/completions" | b"/v1/completions"
            )
        {
            carried_inference = true;
            sh.inference_connections
                .set(sh.inference_connections.get() + 1);
        }
        let next = handle(&sh, &head, &body, &mut reader, &mut wr).await;
        if matches!(next, Next::Close) || !head.keep_alive || sh.shutdown.is_set() {
            return;
        }
    }
}
