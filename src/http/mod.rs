//! HTTP/1.1 framing, pure: no sockets, no clocks. Everything here is fed bytes and answers with
//! offsets, so it is property-tested and fuzzed alone (`fuzz/`), and the proxy layer owns all I/O.

pub mod chunked;
pub mod head;
pub mod method;
pub mod response;

pub use chunked::{ChunkError, ChunkTracker, ChunkedDecoder};
pub use head::{
    parse_request_head, parse_response_head, BodyFraming, HeadError, HeadLimits, HeaderSpan,
    RequestHead, ResponseHead, Span,
};
pub use method::Method;
