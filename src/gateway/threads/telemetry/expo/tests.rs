use super::*;

/// What SGLang 0.5.2x writes (labels abbreviated), with newer builds' split cached counter.
const SGLANG: &str = "# HELP sglang:num_running_reqs The number of running requests.\n\
# TYPE sglang:num_running_reqs gauge\n\
sglang:num_running_reqs{model_name=\"m\",dp_rank=\"0\"} 3.0\n\
sglang:num_running_reqs{model_name=\"m\",dp_rank=\"1\"} 2.0\n\
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n\
# TYPE sglang:num_queue_reqs gauge\n\
sglang:num_queue_reqs{model_name=\"m\",dp_rank=\"0\"} 4.0\n\
sglang:num_queue_reqs{model_name=\"m\",dp_rank=\"1\"} 0.0\n\
# HELP sglang:token_usage The token usage.\n\
# TYPE sglang:token_usage gauge\n\
sglang:token_usage{model_name=\"m\",dp_rank=\"0\"} 0.25\n\
sglang:token_usage{model_name=\"m\",dp_rank=\"1\"} 0.5\n\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.\n\
# TYPE sglang:prompt_tokens_total counter\n\
sglang:prompt_tokens_total{model_name=\"m\"} 1000.0\n\
# HELP sglang:cached_tokens_total Number of cached prompt tokens.\n\
# TYPE sglang:cached_tokens_total counter\n\
sglang:cached_tokens_total{model_name=\"m\",cache_source=\"device\"} 500.0\n\
sglang:cached_tokens_total{model_name=\"m\",cache_source=\"host\"} 100.0\n\
sglang:cached_tokens_total{model_name=\"m\",cache_source=\"total\"} 600.0\n\
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.\n\
# TYPE sglang:time_to_first_token_seconds histogram\n\
sglang:time_to_first_token_seconds_bucket{le=\"0.1\",model_name=\"m\"} 1.0\n\
sglang:time_to_first_token_seconds_bucket{le=\"+Inf\",model_name=\"m\"} 2.0\n\
sglang:time_to_first_token_seconds_sum{model_name=\"m\"} 0.5\n\
sglang:time_to_first_token_seconds_count{model_name=\"m\"} 2.0\n";

#[test]
fn engine_numbers_sum_ranks_and_count_cached_tokens_once() {
    let s = EngineStats::from_text(SGLANG);
    assert_eq!(s.running, Some(5.0));
    assert_eq!(s.queued, Some(4.0));
    assert_eq!(s.token_usage, Some(0.5), "the fullest rank");
    assert_eq!(s.prompt_tokens, Some(1000.0));
    assert_eq!(s.cached_tokens, Some(600.0), "total preferred, not 1200");
    assert_eq!(s.load(), Some((5.0, 4.0)));
}

#[test]
fn cached_tokens_without_a_total_series_are_summed() {
    // Older SGLang: no cache_source label at all. A build with only the split series: summed.
    let old = "sglang:cached_tokens_total{model_name=\"m\"} 7\n";
    assert_eq!(EngineStats::from_text(old).cached_tokens, Some(7.0));
    let split = "sglang:cached_tokens_total{cache_source=\"device\"} 7\n\
                 sglang:cached_tokens_total{cache_source=\"host\"} 3\n";
    assert_eq!(EngineStats::from_text(split).cached_tokens, Some(10.0));
    // The simulator's shape: device and total carry the same number.
    let sim = "sglang:cached_tokens_total{model_name=\"m\",cache_source=\"device\"} 40\n\
               sglang:cached_tokens_total{model_name=\"m\",cache_source=\"total\"} 40\n";
    assert_eq!(EngineStats::from_text(sim).cached_tokens, Some(40.0));
}

#[test]
fn unreadable_lines_are_skipped_not_fatal() {
    let text = "garbage line\n\
                sglang:num_running_reqs{model_name=\"m\" 3\n\
                sglang:num_running_reqs{model_name=\"m\"} notanumber\n\
                sglang:num_running_reqs 2 1700000000000\r\n\
                sglang:num_running_reqs{a=\"}\\\"\"} 1\n\
                sglang:num_queue_reqs NaN\n\
                sglang:num_queue_reqs -4\n\
                sglang:num_queue_reqs{x=\"y\",} 1e0\n\
                # TYPE\n\
                #\n\n";
    let s = EngineStats::from_text(text);
    assert_eq!(s.running, Some(3.0));
    assert_eq!(s.queued, Some(1.0));
    assert_eq!(s.prompt_tokens, None);
    assert_eq!(s.load(), Some((3.0, 1.0)));
    assert_eq!(EngineStats::from_text("").load(), None);
}

#[test]
fn lines_and_label_sets() {
    assert_eq!(
        parse_line("# HELP a_b some help"),
        Line::Help("a_b", "some help")
    );
    assert_eq!(
        parse_line("# TYPE a_b counter"),
        Line::Type("a_b", "counter")
    );
    assert_eq!(parse_line("# a comment"), Line::Skip);
    let Line::Sample(x) = parse_line("x{le=\"+Inf\",b=\"q\\\"}\"} +Inf 17") else {
        panic!()
    };
    assert_eq!((x.name, x.value, x.rest), ("x", f64::INFINITY, "+Inf 17"));
    assert_eq!(
        label_pairs(x.labels).unwrap(),
        vec![("le", "\"+Inf\""), ("b", "\"q\\\"}\"")]
    );
    assert_eq!(label(x.labels, "le"), Some("+Inf"));
    assert!(label_pairs("a=b").is_none());
    assert!(label_pairs("a=\"b\" c=\"d\"").is_none());
    assert!(label_pairs("=\"b\"").is_none());
    assert_eq!(label_pairs("").unwrap(), vec![]);
}

#[test]
fn get_load_shapes() {
    let j = |s: &str| serde_json::from_str::<Value>(s).unwrap();
    assert_eq!(load_from_json(&j(r#"{"load": 7}"#)), Some((7.0, 0.0)));
    assert_eq!(
        load_from_json(&j(
            r#"[{"dp_rank":0,"num_reqs":5,"num_waiting_reqs":2},{"dp_rank":1,"num_reqs":1,"num_waiting_reqs":0}]"#
        )),
        Some((4.0, 2.0))
    );
    assert_eq!(
        load_from_json(&j(
            r#"{"loads":[{"num_running_reqs":3,"num_waiting_reqs":1}]}"#
        )),
        Some((3.0, 1.0))
    );
    for bad in [
        r#"{"x":1}"#,
        r#"[{"num_waiting_reqs":1}]"#,
        "3",
        "null",
        r#"{"load":-1}"#,
    ] {
        assert_eq!(load_from_json(&j(bad)), None, "{bad}");
    }
}

#[test]
fn merge_labels_every_sample_and_keeps_one_help_per_family() {
    let mut m = Merger::new(1 << 20);
    assert!(m.add("http://10.0.0.1:30000", SGLANG));
    assert!(m.add("http://10.0.0.2:30000", SGLANG));
    let out = m.finish();
    assert_eq!(out.matches("# HELP sglang:num_running_reqs ").count(), 1);
    assert_eq!(
        out.matches("# TYPE sglang:time_to_first_token_seconds histogram")
            .count(),
        1
    );
    let samples: Vec<&str> = out.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(samples.len(), 2 * 14);
    for s in &samples {
        assert!(
            s.contains("{worker=\"http://10.0.0.1:30000\",")
                || s.contains("{worker=\"http://10.0.0.2:30000\","),
            "{s}"
        );
    }
    // Each family's samples are together (both workers), right after its TYPE line.
    let ttft: Vec<usize> = out
        .lines()
        .enumerate()
        .filter(|(_, l)| l.starts_with("sglang:time_to_first_token_seconds"))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(ttft.len(), 8);
    assert_eq!(ttft[7] - ttft[0], 7, "contiguous");
    assert!(out.contains(
        "sglang:time_to_first_token_seconds_bucket{worker=\"http://10.0.0.2:30000\",le=\"+Inf\",model_name=\"m\"} 2.0\n"
    ));
}

#[test]
fn merge_handles_untyped_clashing_and_interleaved_families() {
    let a = "plain 1\n\
             # TYPE t gauge\n\
             t{worker=\"engine-side\"} 2\n\
             # TYPE c counter\n\
             c_total 1\n";
    let b = "# TYPE t counter\n\
             t 5\n\
             # TYPE c counter\n\
             c_total 2\n\
             # TYPE plain gauge\n\
             plain 3\n";
    let mut m = Merger::new(1 << 20);
    m.add("http://a:1", a);
    m.add("http://b:1", b);
    assert_eq!(
        m.type_conflicts, 2,
        "t and plain are typed differently by b"
    );
    let out = m.finish();
    assert!(out.contains("# TYPE plain untyped\nplain{worker=\"http://a:1\"} 1\n"));
    assert!(out.contains("# HELP plain Reported by the workers (no HELP text).\n"));
    assert!(out.contains("t{worker=\"http://a:1\",exported_worker=\"engine-side\"} 2\n"));
    assert!(!out.contains("t{worker=\"http://b:1\"}"));
    assert!(out.contains("c_total{worker=\"http://a:1\"} 1\nc_total{worker=\"http://b:1\"} 2\n"));
}

#[test]
fn merge_is_capped_per_whole_worker() {
    let one = {
        let mut m = Merger::new(usize::MAX);
        m.add("http://a:1", SGLANG);
        m.bytes
    };
    let mut m = Merger::new(one * 2 + one / 2);
    assert!(m.add("http://a:1", SGLANG));
    assert!(m.add("http://b:1", SGLANG));
    assert!(!m.add("http://c:1", SGLANG), "would pass the cap");
    assert_eq!(m.left_out, 1);
    let out = m.finish();
    assert!(!out.contains("http://c:1"));
    assert!(out.contains("1 worker(s) left out"));
}

#[test]
fn per_rank_load_follows_the_dp_rank_label() {
    assert_eq!(load_by_rank(SGLANG, 2), Some(vec![7.0, 2.0]));
    assert_eq!(
        load_by_rank(SGLANG, 1),
        None,
        "a rank beyond the server's: no split"
    );
    let unlabelled = "sglang:num_running_reqs{model_name=\"m\"} 3\n";
    assert_eq!(load_by_rank(unlabelled, 2), None);
    assert_eq!(load_by_rank("# nothing\n", 2), None);
}

#[test]
fn used_tokens_are_summed_over_ranks() {
    // With the usage, the KV capacity in tokens (the saturation admission's token estimate).
    let text = "sglang:num_used_tokens{model_name=\"m\",dp_rank=\"0\"} 1000.0\n\
                sglang:num_used_tokens{model_name=\"m\",dp_rank=\"1\"} 2000.0\n";
    assert_eq!(EngineStats::from_text(text).used_tokens, Some(3000.0));
    assert_eq!(EngineStats::from_text(SGLANG).used_tokens, None);
}

/// What vLLM 0.33.0 writes for two DP engines (names and label order as in
/// `vllm/v1/metrics/loggers.py`, rendered by prometheus_client: counters gain `_total` and
/// `_created`, `vllm:cache_config_info` is a gauge set to 1 whose labels are the cache config).
const VLLM: &str = "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
# TYPE vllm:num_requests_running gauge\n\
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 1.0\n\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\n\
vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 0.0\n\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
# TYPE vllm:kv_cache_usage_perc gauge\n\
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\n\
vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.25\n\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
# TYPE vllm:cache_config_info gauge\n\
vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"1000\"} 1.0\n\
vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"1\",gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"1000\"} 1.0\n\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.\n\
# TYPE vllm:prefix_cache_queries_total counter\n\
vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 800.0\n\
vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"m\"} 200.0\n\
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.\n\
# TYPE vllm:prefix_cache_queries_created gauge\n\
vllm:prefix_cache_queries_created{engine=\"0\",model_name=\"m\"} 1.7e+09\n\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n\
# TYPE vllm:prefix_cache_hits_total counter\n\
vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 400.0\n\
vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 50.0\n\
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n\
# TYPE vllm:prompt_tokens_total counter\n\
vllm:prompt_tokens_total{engine=\"0\",model_name=\"m\"} 5000.0\n";

#[test]
fn vllm_names_give_the_same_numbers() {
    let s = EngineStats::from_text(VLLM);
    assert_eq!(s.load(), Some((4.0, 2.0)));
    assert_eq!(s.token_usage, Some(0.5), "the fullest engine");
    // 0.5 × 16,000 + 0.25 × 16,000 tokens in use.
    assert_eq!(s.used_tokens, Some(12_000.0));
    // Hits out of the tokens the prefix cache was asked about (not prompt_tokens_total).
    assert_eq!(s.cached_tokens, Some(450.0));
    assert_eq!(s.prompt_tokens, Some(1000.0));
    // An older server's usage gauge; an engine without its capacity adds no used tokens.
    let old = "vllm:gpu_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.75\n\
               vllm:gpu_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5\n\
               vllm:cache_config_info{block_size=\"8\",engine=\"1\",num_gpu_blocks=\"10\"} 1.0\n";
    let s = EngineStats::from_text(old);
    assert_eq!(s.token_usage, Some(0.75));
    assert_eq!(s.used_tokens, Some(40.0));
    // A server exporting both usage gauges counts each engine once.
    let both = format!("{old}vllm:kv_cache_usage_perc{{engine=\"1\",model_name=\"m\"}} 0.5\n");
    assert_eq!(EngineStats::from_text(&both).used_tokens, Some(40.0));
    assert_eq!(EngineStats::from_text(SGLANG).used_tokens, None);
}
