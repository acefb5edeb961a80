use super::*;

fn shape() -> ServerShape {
    ServerShape {
        model: "m".into(),
        dp: 8,
        block_size: 16,
        http_base: 11000,
        pub_base: 12100,
        replay_base: 20400,
        buffer_steps: 64,
    }
}

#[test]
fn server_info_is_what_the_gateway_reads() {
    let s = shape();
    let v: Value = serde_json::from_str(&server_info(&s, 3).to_string()).unwrap();
    let d = &v["kv_events"];
    assert_eq!(d["publisher"], "zmq");
    assert_eq!(d["endpoint_port_base"], 12100 + 24);
    assert_eq!(d["replay_endpoint_port_base"], 20400 + 24);
    assert_eq!(d["dp_size"], 8);
    assert_eq!(d["block_size"], 16);
    assert_eq!(v["page_size"], 16);
    assert_eq!(v["served_model_name"], "m");
    let cfg: Value = serde_json::from_str(v["kv_events_config"].as_str().unwrap()).unwrap();
    assert_eq!(cfg["endpoint"], "tcp://*:12124");
    // The gateway's own parser agrees.
    let info = radixgate::gateway::kv_routing::parse_server_info(
        v.to_string().as_bytes(),
        "http://127.0.0.1:11003",
    )
    .unwrap();
    assert_eq!(info.ranks, 8);
    assert_eq!(info.block_size, Some(16));
}

#[test]
fn answers_parse() {
    let s = shape();
    for (m, p) in [
        ("GET", "/get_model_info"),
        ("GET", "/v1/models"),
        ("POST", "/generate"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
    ] {
        let (st, ct, body) = answer(&s, 9, m, p);
        assert_eq!((st, ct), (200, "application/json"), "{p}");
        let v: Value = serde_json::from_slice(&body).unwrap();
        let text = v
            .get("text")
            .or_else(|| v.pointer("/choices/0/text"))
            .or_else(|| v.pointer("/choices/0/message/content"));
        if m == "POST" {
            assert_eq!(text.and_then(|t| t.as_str()), Some("s9"), "{p}");
        }
    }
    assert_eq!(answer(&s, 0, "GET", "/health").0, 200);
    assert_eq!(answer(&s, 0, "GET", "/nope").0, 404);
    let metrics = String::from_utf8(answer(&s, 0, "GET", "/metrics").2).unwrap();
    let samples = crate::fleet::prom::parse(&metrics);
    assert_eq!(samples.len(), 4 * 8);
    assert!(s.check(1024).is_ok());
    assert!(s.check(8000).is_err(), "ranges overlap");
}

#[test]
fn requests_parse_by_length_and_chunks() {
    let r = b"POST /generate HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}GET /h";
    let (m, p, close, used) = parse_request(r).unwrap().unwrap();
    assert_eq!(
        (m.as_str(), p.as_str(), close, used),
        ("POST", "/generate", false, r.len() - 6)
    );
    assert!(parse_request(b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\n{}").is_none());
    let c = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n2\r\n{}\r\n0\r\n\r\n";
    let (_, _, close, used) = parse_request(c).unwrap().unwrap();
    assert!(close);
    assert_eq!(used, c.len());
    let mut out = Vec::new();
    response(200, "text/plain", b"ok", false, &mut out);
    assert_eq!(
        out,
        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
    );
}
