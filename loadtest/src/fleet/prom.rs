//! Reading the gateway's Prometheus text, pure: sums of a family's samples under a label
//! filter, and quantiles of a histogram's bucket deltas.

/// One sample: family name, labels, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name (with `_bucket`/`_sum`/`_count` suffixes as written).
    pub name: String,
    /// Labels in order.
    pub labels: Vec<(String, String)>,
    /// Value.
    pub value: f64,
}

/// Parse an exposition (comments skipped; malformed lines skipped).
pub fn parse(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (head, value) = match line.rfind('}') {
            Some(b) => (&line[..=b], line[b + 1..].trim()),
            None => match line.split_once(' ') {
                Some((h, v)) => (h, v.trim()),
                None => continue,
            },
        };
        let value = value.split(' ').next().unwrap_or("");
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let (name, labels) = match head.split_once('{') {
            Some((n, rest)) => (n, parse_labels(rest.trim_end_matches('}'))),
            None => (head, Vec::new()),
        };
        out.push(Sample {
            name: name.to_owned(),
            labels,
            value,
        });
    }
    out
}

fn parse_labels(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some((k, r)) = rest.split_once("=\"") {
        let mut v = String::new();
        let mut chars = r.char_indices();
        let mut end = r.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        v.push(if n == 'n' { '\n' } else { n });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => v.push(c),
            }
        }
        out.push((k.trim_start_matches(',').trim().to_owned(), v));
        rest = r[end..].trim_start_matches(',');
    }
    out
}

/// Sum of `name`'s samples whose labels include every `(k, v)` of `filter`; `None` when the
/// family has no such sample.
pub fn sum(samples: &[Sample], name: &str, filter: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for s in samples.iter().filter(|s| s.name == name) {
        if filter
            .iter()
            .all(|(k, v)| s.labels.iter().any(|(a, b)| a == k && b == v))
        {
            *found.get_or_insert(0.0) += s.value;
        }
    }
    found
}

/// A histogram's cumulative buckets `(le, count)` summed over its label sets, sorted by `le`.
pub fn buckets(samples: &[Sample], family: &str) -> Vec<(f64, f64)> {
    let name = format!("{family}_bucket");
    let mut b: Vec<(f64, f64)> = Vec::new();
    for s in samples.iter().filter(|s| s.name == name) {
        let Some(le) = s.labels.iter().find(|(k, _)| k == "le") else {
            continue;
        };
        let le = if le.1 == "+Inf" {
            f64::INFINITY
        } else {
            match le.1.parse() {
                Ok(v) => v,
                Err(_) => continue,
            }
        };
        match b.iter_mut().find(|(l, _)| *l == le) {
            Some((_, c)) => *c += s.value,
            None => b.push((le, s.value)),
        }
    }
    b.sort_by(|x, y| x.0.total_cmp(&y.0));
    b
}

/// Bucket deltas `after − before` (same `le`s), cumulative.
pub fn delta(before: &[(f64, f64)], after: &[(f64, f64)]) -> Vec<(f64, f64)> {
    after
        .iter()
        .map(|&(le, c)| {
            let b = before.iter().find(|(l, _)| *l == le).map_or(0.0, |x| x.1);
            (le, (c - b).max(0.0))
        })
        .collect()
}

/// Quantile `q` of cumulative buckets, interpolated linearly inside the bucket (Prometheus'
/// `histogram_quantile`); the `+Inf` bucket answers its lower bound. `None` without counts.
pub fn quantile(b: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = b.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, c) in b {
        if c >= rank {
            if le.is_infinite() {
                return Some(prev.0);
            }
            let span = c - prev.1;
            let f = if span > 0.0 {
                (rank - prev.1) / span
            } else {
                1.0
            };
            return Some(prev.0 + (le - prev.0) * f);
        }
        prev = (le, c);
    }
    Some(prev.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP x y\n# TYPE radixgate_kv_events_total counter\n\
radixgate_kv_events_total{kind=\"event\"} 10\nradixgate_kv_events_total{kind=\"gap\"} 2\n\
radixgate_kv_warm_workers 4\n\
h_bucket{le=\"0.001\"} 1\nh_bucket{le=\"0.01\"} 3\nh_bucket{le=\"+Inf\"} 4\nh_sum 0.1\nh_count 4\n\
q{a=\"x\\\"y\",kind=\"gap\"} 1.5e0\n";

    #[test]
    fn sums_and_filters() {
        let s = parse(TEXT);
        assert_eq!(
            sum(&s, "radixgate_kv_events_total", &[("kind", "event")]),
            Some(10.0)
        );
        assert_eq!(sum(&s, "radixgate_kv_events_total", &[]), Some(12.0));
        assert_eq!(sum(&s, "radixgate_kv_warm_workers", &[]), Some(4.0));
        assert_eq!(sum(&s, "absent", &[]), None);
        assert_eq!(sum(&s, "q", &[("kind", "gap")]), Some(1.5));
        assert_eq!(s.last().unwrap().labels[0].1, "x\"y");
    }

    #[test]
    fn histogram_quantiles() {
        let s = parse(TEXT);
        let b = buckets(&s, "h");
        assert_eq!(b.len(), 3);
        assert_eq!(quantile(&b, 0.25), Some(0.001));
        let p50 = quantile(&b, 0.5).unwrap();
        assert!((p50 - 0.0055).abs() < 1e-9, "{p50}");
        assert_eq!(
            quantile(&b, 1.0),
            Some(0.01),
            "the +Inf bucket answers its lower bound"
        );
        let d = delta(&b, &b);
        assert_eq!(quantile(&d, 0.5), None);
    }
}
