#!/usr/bin/env python3
"""Summarise a compare-policies run: results/<timestamp>/ → report.md (+ chart.png).

Layout read (written by scripts/compare-policies.sh):
  meta.json                      {"workload", "workers", "duration", ...}
  runs/<NN>-<slug>/run.json      {"policy", "gateway", "label", "status"}
  runs/<NN>-<slug>/loadgen.json  the loadgen report
  runs/<NN>-<slug>/before-<i>.prom, after-<i>.prom   each worker's /metrics around the run
  runs/<NN>-<slug>/gateway-before.prom, gateway-after.prom   radixgate's /metrics around the run
  runs/<NN>-<slug>/decode-before-<j>.prom, decode-after-<j>.prom   --pd: each decode server's

Beside report.md it writes docs.md: the short table docs/benchmarks.md shows (policy, the servers'
hit rate, TTFT, ok / sent), which scripts/compare-policies.sh --write-docs puts there.

With --pd (meta.json "pd": true) the before-/after- workers are the prefill servers, so the hit
rate is the prefill side's; the report gets the PD table, its own acceptance lines, and for a
failing or erroring gateway the lines it printed (gateway.log, warmup.log).

Hit rate is token-weighted from the workers' own counters: Δ sglang:cached_tokens_total
{cache_source="total"} / Δ sglang:prompt_tokens_total (vLLM workers: Δ
vllm:prefix_cache_hits_total / Δ vllm:prompt_tokens_total), summed over workers. The chart needs
matplotlib (the script's .venv); without it only the markdown is written.
Standard library only, apart from the optional chart.
"""

import json
import os
import re
import sys

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfINFaN]+)')


def parse_prom(path):
    """{metric: [(labels_text, value)]} from a Prometheus text exposition file."""
    out = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("#"):
                    continue
                m = SAMPLE.match(line.strip())
                if m:
                    out.setdefault(m.group(1), []).append((m.group(2) or "", float(m.group(3))))
    except OSError:
        pass
    return out


def total(metrics, name, label_filter=None):
    vals = metrics.get(name, [])
    if label_filter is not None:
        with_label = [v for lab, v in vals if label_filter[0] in lab]
        if with_label:
            return sum(v for lab, v in vals if f'{label_filter[0]}="{label_filter[1]}"' in lab)
    return sum(v for _, v in vals)


def worker_deltas(run_dir, prefix=""):
    """Per worker (Δprompt, Δcached, Δrequests) from <prefix>before-/<prefix>after- scrapes."""
    rows = []
    i = 0
    while os.path.exists(os.path.join(run_dir, f"{prefix}before-{i}.prom")):
        b = parse_prom(os.path.join(run_dir, f"{prefix}before-{i}.prom"))
        a = parse_prom(os.path.join(run_dir, f"{prefix}after-{i}.prom"))
        d = lambda name, lf=None: total(a, name, lf) - total(b, name, lf)
        # A worker is read by the names it exports: SGLang's, else vLLM's (its hits over all
        # prompt tokens, the same ratio as SGLang's cached over prompt tokens).
        if "vllm:prompt_tokens_total" in a:
            rows.append((
                d("vllm:prompt_tokens_total"),
                d("vllm:prefix_cache_hits_total"),
                d("vllm:request_success_total"),
                d("vllm:evicted_tokens_total"),
            ))
        else:
            rows.append((
                d("sglang:prompt_tokens_total"),
                d("sglang:cached_tokens_total", ("cache_source", "total")),
                d("sglang:num_requests_total"),
                # The simulator's own counter (SGLang has none): proves the run was under memory
                # pressure. Absent (0) on real servers.
                d("sglang:evicted_tokens_total"),
            ))
        i += 1
    return rows


def fmt_pct(x):
    return "n/a" if x is None else f"{100 * x:.1f} %"


def fmt_ms(x):
    return "n/a" if x is None else (f"{x:.0f}" if x >= 100 else f"{x:.1f}")


def load_runs(root):
    runs_dir = os.path.join(root, "runs")
    runs = []
    for name in sorted(os.listdir(runs_dir)) if os.path.isdir(runs_dir) else []:
        d = os.path.join(runs_dir, name)
        try:
            with open(os.path.join(d, "run.json")) as f:
                run = json.load(f)
        except (OSError, ValueError):
            continue
        try:
            with open(os.path.join(d, "loadgen.json")) as f:
                run["lg"] = json.load(f)
        except (OSError, ValueError):
            run["lg"] = None
        w = worker_deltas(d)
        run["workers"] = w
        prompt = sum(r[0] for r in w)
        cached = sum(r[1] for r in w)
        run["hit"] = cached / prompt if prompt > 0 else None
        run["evicted"] = sum(r[3] for r in w)
        run["prompt_tokens"] = prompt
        reqs = [r[2] for r in w]
        mean = sum(reqs) / len(reqs) if reqs else 0
        run["spread"] = (max(reqs) / mean) if mean > 0 else None
        run["reqs"] = reqs
        run["decode_reqs"] = [r[2] for r in worker_deltas(d, "decode-")]
        run["probe_reqs"] = [r[2] for r in worker_deltas(d, "probe-")]
        run["printed"] = printed(d)
        gb = parse_prom(os.path.join(d, "gateway-before.prom"))
        ga = parse_prom(os.path.join(d, "gateway-after.prom"))
        fb = {}
        for lab, v in ga.get("radixgate_kv_fallback_total", []):
            m = re.search(r'reason="([^"]*)"', lab)
            prev = sum(x for l2, x in gb.get("radixgate_kv_fallback_total", []) if l2 == lab)
            if m and v - prev > 0:
                fb[m.group(1)] = v - prev
        run["kv_fallbacks"] = fb
        run["routed"] = total(ga, "smg_worker_selection_total") - total(gb, "smg_worker_selection_total")
        kp = total(ga, "radixgate_kv_prompt_tokens_total") - total(gb, "radixgate_kv_prompt_tokens_total")
        kc = (total(ga, "radixgate_kv_predicted_cached_tokens_total")
              - total(gb, "radixgate_kv_predicted_cached_tokens_total"))
        run["kv_predicted"] = kc / kp if kp > 0 else None
        runs.append(run)
    return runs


ERROR_LINE = re.compile(r"error|fail|panic|warn|refused|unavailable|no .*worker", re.I)


def printed(run_dir, limit=6):
    """The distinct error-looking lines a gateway (and the warm-up loadgen) printed, with counts,
    numbers and ids masked so repeats fold together: [(count, line)]."""
    counts = {}
    order = []
    for name in ("gateway.log", "warmup.log", "loadgen.log"):
        try:
            with open(os.path.join(run_dir, name), encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            line = re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
            if not line or not ERROR_LINE.search(line):
                continue
            key = re.sub(r"\d", "#", line)[:300]
            if key not in counts:
                counts[key] = [0, f"{name}: {line[:300]}"]
                order.append(key)
            counts[key][0] += 1
    return [tuple(counts[k]) for k in order][:limit]


def pd_acceptance(runs):
    """--pd: the prefill side's hit rate and TTFT, cache_aware against round_robin and the reference."""
    by = {r["label"]: r for r in runs if r.get("status") == "ok" and r["lg"]}
    lines = []

    def check(name, ok, detail):
        lines.append(f"- {'PASS' if ok else 'FAIL'} — {name}: {detail}")

    ca, rr, sg = by.get("cache_aware"), by.get("round_robin"), by.get("sglang-router cache_aware")
    if ca:
        check("PD radixgate cache_aware answers every request", ca["lg"]["ok"] == ca["lg"]["sent"],
              f"{ca['lg']['ok']} / {ca['lg']['sent']}")
    if ca and rr and ca["hit"] is not None and rr["hit"] is not None:
        check("PD prefill hit rate: cache_aware > round_robin", ca["hit"] > rr["hit"],
              f"{fmt_pct(ca['hit'])} vs {fmt_pct(rr['hit'])}")
        a, b = ca["lg"]["ttft"]["p50_ms"], rr["lg"]["ttft"]["p50_ms"]
        check("PD TTFT p50: cache_aware ≤ round_robin", a <= b, f"{fmt_ms(a)} ms vs {fmt_ms(b)} ms")
    for r in (ca, sg):
        if r and r["probe_reqs"] and sum(r["probe_reqs"]):
            name = r["label"] if r["label"].startswith(r["gateway"]) else f"{r['gateway']} {r['label']}"
            check(f"PD {name} keeps a repeated prompt on one prefill server",
                  max(r["probe_reqs"]) == sum(r["probe_reqs"]),
                  " ".join(str(int(x)) for x in r["probe_reqs"]))
    if ca and sg:
        sent = sg["lg"]["sent"]
        err = 1 - sg["lg"]["ok"] / sent if sent else 1.0
        check("PD sglang-router 0.3.2 cache_aware answers every request", err == 0,
              f"{sg['lg']['ok']} / {sent} ({100 * err:.1f} % errors)")
        if ca["hit"] is not None and sg["hit"] is not None:
            check("PD prefill hit rate: radixgate cache_aware ≥ sglang-router's", ca["hit"] >= sg["hit"] - 1e-9,
                  f"{fmt_pct(ca['hit'])} vs {fmt_pct(sg['hit'])}")
        if sg["lg"]["ok"]:
            a, b = ca["lg"]["ttft"]["p99_ms"], sg["lg"]["ttft"]["p99_ms"]
            check("PD TTFT p99: radixgate cache_aware ≤ sglang-router's", a <= b, f"{fmt_ms(a)} ms vs {fmt_ms(b)} ms")
    return lines


def pd_table(runs):
    out = ["| prefill policy | gateway | prefill hit rate (prefill servers) | TTFT p50 ms | TTFT p99 ms | E2E p99 ms "
           "| req/s | ok / sent | prefill spread max/mean | requests per prefill server | requests per decode server "
           "| one prompt ×N, per prefill server |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lg = r["lg"]
        if r.get("status") != "ok" or not lg:
            out.append(f"| {r['label']} | {r['gateway']} | failed: {r.get('status', '?')} | | | | | | | | | |")
            continue
        probe = " ".join(str(int(x)) for x in r["probe_reqs"]) or "n/a"
        spread = "n/a" if r["spread"] is None else f"{r['spread']:.2f}"
        ttft = (lambda k: fmt_ms(lg["ttft"][k])) if lg["ok"] else (lambda k: "n/a")
        e2e = fmt_ms(lg["e2e"]["p99_ms"]) if lg["ok"] else "n/a"
        out.append(
            f"| {r['label']} | {r['gateway']} | {fmt_pct(r['hit'])} | {ttft('p50_ms')} | {ttft('p99_ms')} | {e2e} "
            f"| {lg['req_per_s']:.2f} | {lg['ok']} / {lg['sent']} | {spread} "
            f"| {' '.join(str(int(x)) for x in r['reqs'])} | {' '.join(str(int(x)) for x in r['decode_reqs'])} "
            f"| {probe} |"
        )
    return out


def acceptance(meta, runs):
    by = {r["label"]: r for r in runs if r.get("status") == "ok"}
    lines = []

    def check(name, ok, detail):
        lines.append(f"- {'PASS' if ok else 'FAIL'} — {name}: {detail}")

    ca = by.get("cache_aware")
    sg = by.get("sglang-router cache_aware")
    if meta.get("workload") == "gsp":
        rr = by.get("round_robin")
        if rr and rr["hit"] is not None:
            check("gsp round_robin ≈ 20 %", 0.10 <= rr["hit"] <= 0.35, fmt_pct(rr["hit"]))
        if ca and ca["hit"] is not None:
            check("gsp cache_aware ≥ 70 %", ca["hit"] >= 0.70, fmt_pct(ca["hit"]))
    if meta.get("workload") == "chat":
        oracle = by.get("manual+session_header")
        if ca and oracle and ca["hit"] is not None and oracle["hit"]:
            ratio = ca["hit"] / oracle["hit"]
            check("chat cache_aware ≥ 90 % of the sticky-session oracle", ratio >= 0.9,
                  f"{fmt_pct(ca['hit'])} vs {fmt_pct(oracle['hit'])} ({100 * ratio:.0f} %)")
        kv = by.get("cache_aware+kv_events")
        if kv and kv["hit"] is not None:
            # The memory-pressure claims need servers that actually evicted during these runs.
            pressed = [r for r in (kv, ca, oracle) if r]
            evicting = all(r.get("evicted", 0) > 0 for r in pressed)
            check("chat runs were under memory pressure (the simulated servers evicted)", evicting,
                  "; ".join(f"{r['label']}: {int(r.get('evicted', 0)):,} tokens evicted of "
                            f"{int(r.get('prompt_tokens', 0)):,} prompt tokens" for r in pressed))
            if ca and ca["hit"] is not None:
                check("chat cache_aware+kv_events ≥ cache_aware (text tree)", kv["hit"] >= ca["hit"] - 1e-9,
                      f"{100 * kv['hit']:.2f} % vs {100 * ca['hit']:.2f} %")
            if oracle and oracle["hit"] is not None:
                gap = 100 * (oracle["hit"] - kv["hit"])
                check("chat cache_aware+kv_events within 3 points of the sticky-session oracle", gap <= 3.0,
                      f"{100 * kv['hit']:.2f} % vs {100 * oracle['hit']:.2f} % "
                      f"({abs(gap):.2f} points {'below' if gap > 0 else 'above'})")
            fbn = sum(kv["kv_fallbacks"].values())
            if kv["routed"] and fbn / kv["routed"] > 0.5:
                lines.append(f"  - caveat: {int(fbn)} of {int(kv['routed'])} routed requests fell back to the text "
                             f"tree ({', '.join(sorted(kv['kv_fallbacks']))}): the kv_events row measures the text "
                             f"tree, not the events")
    if ca and sg and ca["hit"] is not None and sg["hit"] is not None:
        check("radixgate cache_aware hit rate ≥ sglang-router's", ca["hit"] >= sg["hit"] - 1e-9,
              f"{fmt_pct(ca['hit'])} vs {fmt_pct(sg['hit'])}")
        if ca["lg"] and sg["lg"]:
            a, b = ca["lg"]["ttft"]["p99_ms"], sg["lg"]["ttft"]["p99_ms"]
            check("radixgate cache_aware TTFT p99 ≤ sglang-router's", a <= b, f"{fmt_ms(a)} ms vs {fmt_ms(b)} ms")
    return lines


def chart(root, meta, runs):
    if os.environ.get("RADIXGATE_NO_CHART"):
        return ""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart skipped: matplotlib is not installed (scripts/compare-policies.sh installs it into .venv/)"
    ok = [r for r in runs if r.get("status") == "ok" and r["lg"]]
    if not ok:
        return "chart skipped: no successful run"
    labels = [r["label"].replace("sglang-router ", "sglang-router\n").replace("+", "\n+") for r in ok]
    x = range(len(ok))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(10, 1.7 * len(ok)), 5.6))
    hits = [100 * (r["hit"] or 0) for r in ok]
    colors = ["tab:orange" if r["gateway"] != "radixgate" else "tab:blue" for r in ok]
    ax1.bar(x, hits, color=colors)
    ax1.set_xticks(list(x), labels, fontsize=7, rotation=35, ha="right", rotation_mode="anchor")
    ax1.set_ylabel("hit rate, % (workers' counters)")
    ax1.set_ylim(0, 100)
    for i, h in enumerate(hits):
        ax1.text(i, h + 1, f"{h:.0f}", ha="center", fontsize=8)
    p50 = [r["lg"]["ttft"]["p50_ms"] for r in ok]
    p99 = [r["lg"]["ttft"]["p99_ms"] for r in ok]
    w = 0.4
    ax2.bar([i - w / 2 for i in x], p50, w, label="TTFT p50")
    ax2.bar([i + w / 2 for i in x], p99, w, label="TTFT p99")
    ax2.set_xticks(list(x), labels, fontsize=7, rotation=35, ha="right", rotation_mode="anchor")
    ax2.set_ylabel("ms (client side)")
    ax2.legend()
    if meta.get("pd"):
        ax1.set_ylabel("prefill hit rate, % (prefill servers' counters)")
        fig.suptitle(f"prefill policies, PD — workload {meta.get('workload', '?')}, {meta.get('prefill_workers', '?')} "
                     f"prefill + {meta.get('decode_workers', '?')} decode ({os.path.basename(os.path.normpath(root))})")
    else:
        fig.suptitle(f"routing policies — workload {meta.get('workload', '?')}, {meta.get('workers', '?')} workers "
                     f"({os.path.basename(os.path.normpath(root))})")
    fig.tight_layout()
    path = os.path.join(root, "chart.png")
    fig.savefig(path, dpi=110)
    return f"![chart](chart.png)"


def main():
    if len(sys.argv) != 2:
        print("usage: report.py RESULTS_DIR", file=sys.stderr)
        return 2
    root = sys.argv[1]
    try:
        with open(os.path.join(root, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        meta = {}
    runs = load_runs(root)
    with open(os.path.join(root, "docs.md"), "w") as f:
        f.write(docs_table(meta, runs))
    pd = bool(meta.get("pd"))
    out = []
    if pd:
        out.append(f"# Prefill/decode policy comparison — workload `{meta.get('workload', '?')}`, "
                   f"{meta.get('prefill_workers', '?')} simulated prefill + {meta.get('decode_workers', '?')} "
                   f"decode servers, decode policy `{meta.get('decode_policy', '?')}`\n")
    else:
        out.append(f"# Policy comparison — workload `{meta.get('workload', '?')}`, {meta.get('workers', '?')} simulated workers\n")
    if meta:
        out.append("Settings: " + ", ".join(f"{k} `{v}`" for k, v in meta.items()) + "\n")
    if pd:
        pd_report(out, root, meta, runs)
        return write_report(root, out)
    out.append("| policy | gateway | hit rate (workers) | hit rate (client) | TTFT p50 ms | TTFT p99 ms | E2E p99 ms | req/s | output tok/s | ok / sent | load spread max/mean | requests per worker |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        lg = r["lg"]
        if r.get("status") != "ok" or not lg:
            out.append(f"| {r['label']} | {r['gateway']} | failed: {r.get('status', '?')} | | | | | | | | | |")
            continue
        spread = "n/a" if r["spread"] is None else f"{r['spread']:.2f}"
        out.append(
            f"| {r['label']} | {r['gateway']} | {fmt_pct(r['hit'])} | {fmt_pct(lg.get('hit_rate'))} "
            f"| {fmt_ms(lg['ttft']['p50_ms'])} | {fmt_ms(lg['ttft']['p99_ms'])} | {fmt_ms(lg['e2e']['p99_ms'])} "
            f"| {lg['req_per_s']:.2f} | {lg['output_tok_per_s']:.0f} | {lg['ok']} / {lg['sent']} "
            f"| {spread} | {' '.join(str(int(x)) for x in r['reqs'])} |"
        )
    kv_rows = [r for r in runs if "kv_events" in r["label"] and r.get("status") == "ok"]
    if kv_rows:
        out.append("\n## KV events\n")
        out.append("| policy | routed requests | text-tree fallbacks (radixgate_kv_fallback_total) | gateway-predicted hit |")
        out.append("|---|---|---|---|")
        for r in kv_rows:
            fb = ", ".join(f"{k} {int(v)}" for k, v in sorted(r["kv_fallbacks"].items())) or "0"
            out.append(f"| {r['label']} | {int(r['routed'])} | {fb} | {fmt_pct(r['kv_predicted'])} |")
    acc = acceptance(meta, runs)
    if acc:
        out.append("\n## Acceptance checks\n")
        out.extend(acc)
    chart_line = chart(root, meta, runs)
    if chart_line:
        out.append("\n" + chart_line + "\n")
    errs = [(r["label"], r["lg"]["errors"]) for r in runs if r["lg"] and r["lg"].get("errors")]
    if errs:
        out.append("## Errors\n")
        for label, e in errs:
            out.append(f"- {label}: " + ", ".join(f"{k} ×{v}" for k, v in e.items()))
    return write_report(root, out)


def pd_report(out, root, meta, runs):
    out.append("Hit rate: Δ cached / Δ prompt tokens on the prefill servers (where prompts are computed); "
               "TTFT, E2E and ok / sent from loadgen through the gateway (the decode server's stream). "
               "\"One prompt ×N\": before the measured run, one ~4k-character /v1/completions prompt sent N times in a "
               "row; where the prefill servers counted them (prefix affinity with no load to balance: all on one "
               "server for a cache-aware policy).\n")
    out.extend(pd_table(runs))
    notes = [(r["label"], r["note"]) for r in runs if r.get("note")]
    for label, note in notes:
        out.append(f"\n- {label}: {note}")
    acc = pd_acceptance(runs)
    if acc:
        out.append("\n## Acceptance checks\n")
        out.extend(acc)
    chart_line = chart(root, meta, runs)
    if chart_line:
        out.append("\n" + chart_line + "\n")
    errs = [(r["label"], r["lg"]["errors"]) for r in runs if r["lg"] and r["lg"].get("errors")]
    if errs:
        out.append("## Errors\n")
        for label, e in errs:
            out.append(f"- {label}: " + ", ".join(f"{k} ×{v}" for k, v in e.items()))
    bad = [r for r in runs if r.get("status") != "ok" or not r["lg"] or r["lg"].get("errors") or r.get("note")]
    if any(r["printed"] for r in bad):
        out.append("\n## What the failing gateways printed\n")
        for r in bad:
            if r["printed"]:
                out.append(f"- {r['label']}:")
                for n, line in r["printed"]:
                    out.append(f"  - ×{n} `{line.replace('`', chr(39))}`")


def docs_table(meta, runs):
    """The table docs/benchmarks.md shows for this run: one row per policy."""
    pd = bool(meta.get("pd"))
    probe = pd and any(r["probe_reqs"] for r in runs)
    head = ("| prefill policy | gateway | prefill servers' hit rate | TTFT p50 / p99 ms | ok / sent"
            + (" | one prompt ×N, per prefill server |" if probe else " |")) if pd else \
        "| policy | gateway | servers' hit rate | TTFT p50 / p99 ms | ok / sent |"
    out = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in runs:
        lg = r["lg"]
        if r.get("status") != "ok" or not lg:
            out.append(f"| {r['label']} | {r['gateway']} | failed: {r.get('status', '?')} | | |" + (" |" if probe else ""))
            continue
        ttft = f"{fmt_ms(lg['ttft']['p50_ms'])} / {fmt_ms(lg['ttft']['p99_ms'])}" if lg["ok"] else "n/a"
        row = f"| {r['label']} | {r['gateway']} | {fmt_pct(r['hit'])} | {ttft} | {lg['ok']} / {lg['sent']} |"
        if probe:
            row += f" {' '.join(str(int(x)) for x in r['probe_reqs']) or 'n/a'} |"
        out.append(row)
    if pd:
        out.append(f"\n{meta.get('prefill_workers', '?')} prefill + {meta.get('decode_workers', '?')} decode servers, "
                   f"decode policy `{meta.get('decode_policy', '?')}`, workload `{meta.get('workload', '?')}`, "
                   f"{meta.get('duration_s', '?')} s.")
    else:
        evicted = sum(r.get("evicted", 0) for r in runs if r.get("status") == "ok")
        prompt = sum(r.get("prompt_tokens", 0) for r in runs if r.get("status") == "ok")
        out.append(f"\nWorkload `{meta.get('workload', '?')}`, {meta.get('workers', '?')} workers of "
                   f"{meta.get('kv_tokens_per_worker', '?')} KV tokens, {meta.get('duration_s', '?')} s"
                   + (f"; the servers evicted {int(evicted):,} of {int(prompt):,} prompt tokens over the runs."
                      if evicted else "; nothing evicted."))
    return "\n".join(out) + "\n"


def write_report(root, out):
    text = "\n".join(out) + "\n"
    with open(os.path.join(root, "report.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
