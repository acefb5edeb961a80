#!/usr/bin/env python3
"""Follow a few conversations turn by turn and record which worker answered each turn.

Used by scripts/multi-gateway.sh for the "new copy mid-run" check: conversations are started
through the front (their first turns spread over the running copies), then a new radixgate copy
is started and the next turn of each is sent straight to it. The simulated workers answer with
an `x-worker-port` header and report cached tokens, so the state file shows, per conversation,
where the earlier turns went, where the new copy sent the next one, and the server's hit on it.

  gateway-probe.py start  --state F --target URL --api generate-ids|chat [--conversations K]
                          [--prefix-tokens T] [--turns N] [--seed S]
  gateway-probe.py next   --state F --target URL --label L [--only A-B]
  gateway-probe.py report --state F [--state F2 ...]   (markdown on stdout)

Token ids (generate-ids) are random ids below 100 000 (the simulator's approx vocabulary);
chat prompts are random words. Loopback targets only. Standard library only.
"""

import argparse
import http.client
import json
import random
import sys
import time
import urllib.parse

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu "
         "amber basalt cobalt dune ember fjord granite harbor island jade kelp lagoon marble "
         "nectar opal prairie quartz reef saffron tundra umber valley willow yarrow zephyr").split()


def post(target, path, body, timeout=60.0):
    u = urllib.parse.urlparse(target)
    if u.hostname not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"gateway-probe: loopback targets only, not {target}")
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    data = json.dumps(body).encode()
    t0 = time.monotonic()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    raw = r.read()
    ms = (time.monotonic() - t0) * 1000
    port = r.getheader("x-worker-port")
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"{path} -> {r.status}: {raw[:200]!r}")
    return json.loads(raw), port, ms


def user_text(rng, n_words):
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def send_turn(conv, target, rng):
    """Send the conversation's next turn to target; append what happened."""
    api = conv["api"]
    if api == "generate-ids":
        ids = conv["ids"] + [rng.randrange(1, 100_000) for _ in range(conv["turn_tokens"])]
        v, port, ms = post(target, "/generate", {
            "input_ids": ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0.0,
                                                  "ignore_eos": True}})
        meta = v.get("meta_info", {})
        prompt, cached = meta.get("prompt_tokens"), meta.get("cached_tokens")
        conv["ids"] = ids + list(v.get("output_ids") or [])
    else:
        msgs = conv["messages"] + [{"role": "user", "content": user_text(rng, conv["turn_tokens"])}]
        v, port, ms = post(target, "/v1/chat/completions", {
            "model": "default", "messages": msgs, "max_tokens": 16, "temperature": 0.0,
            "ignore_eos": True})
        usage = v.get("usage", {})
        prompt = usage.get("prompt_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        content = v["choices"][0]["message"]["content"]
        conv["messages"] = msgs + [{"role": "assistant", "content": content}]
    conv["turns"].append({"target": target, "port": port, "prompt_tokens": prompt,
                          "cached_tokens": cached, "ms": round(ms, 1)})


def cmd_start(a):
    rng = random.Random(a.seed)
    convs = []
    for k in range(a.conversations):
        c = {"id": k, "api": a.api, "turns": [], "turn_tokens": 64}
        if a.api == "generate-ids":
            c["ids"] = [rng.randrange(1, 100_000) for _ in range(a.prefix_tokens)]
        else:
            # ~1.3 tokens a word with the simulator's tokenizers.
            c["messages"] = [{"role": "system",
                              "content": f"probe {k}: " + user_text(rng, int(a.prefix_tokens / 1.3))}]
        convs.append(c)
    for _ in range(a.turns):
        for c in convs:
            send_turn(c, a.target, rng)
    json.dump({"seed": a.seed, "conversations": convs}, open(a.state, "w"))


def cmd_next(a):
    st = json.load(open(a.state))
    rng = random.Random(st["seed"] + 1000 + len(st["conversations"][0]["turns"]))
    lo, hi = 0, len(st["conversations"]) - 1
    if a.only:
        lo, hi = (int(x) for x in a.only.split("-"))
    for c in st["conversations"][lo:hi + 1]:
        send_turn(c, a.target, rng)
        c["turns"][-1]["label"] = a.label
    json.dump(st, open(a.state, "w"))


def cmd_report(a):
    convs = []
    for path in a.state:
        convs += json.load(open(path))["conversations"]
    rows, groups = [], {}
    for c in convs:
        t = c["turns"]
        probe = [x for x in t if x.get("label")]
        if not probe:
            continue
        last = probe[-1]
        earlier = [x["port"] for x in t[:t.index(last)]]
        prev = earlier[-1] if earlier else None
        ok = last["port"] == prev
        hit = (last["cached_tokens"] / last["prompt_tokens"]) if last.get("prompt_tokens") else None
        g = groups.setdefault(last["label"], [0, 0, []])
        g[0] += ok
        g[1] += 1
        if hit is not None:
            g[2].append(hit)
        rows.append(f"| {len(rows)} | {last['label']} | {' → '.join(str(p) for p in earlier)} | "
                    f"{last['port']} | {'yes' if ok else '**no**'} | "
                    f"{last['cached_tokens']} / {last['prompt_tokens']} "
                    f"({'n/a' if hit is None else f'{100 * hit:.0f} %'}) |")
    print("| conversation | sent to the new copy | earlier turns' workers (through the front) | "
          "new copy's choice | same worker | server cached / prompt tokens |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    summary = {}
    for label, (same, n, hits) in groups.items():
        mean = sum(hits) / len(hits) if hits else 0
        print(f"- {label}: {same} of {n} next turns to the worker that served the previous turn; "
              f"mean server hit on them {100 * mean:.0f} %")
        summary[label] = {"same": same, "n": n, "mean_hit": mean}
    if a.summary:
        json.dump(summary, open(a.summary, "w"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("--state", required=True)
    s.add_argument("--target", required=True)
    s.add_argument("--api", choices=["generate-ids", "chat"], default="generate-ids")
    s.add_argument("--conversations", type=int, default=8)
    s.add_argument("--prefix-tokens", type=int, default=2000)
    s.add_argument("--turns", type=int, default=2)
    s.add_argument("--seed", type=int, default=7)
    n = sub.add_parser("next")
    n.add_argument("--state", required=True)
    n.add_argument("--target", required=True)
    n.add_argument("--label", required=True)
    n.add_argument("--only", help="conversations A-B (inclusive)")
    r = sub.add_parser("report")
    r.add_argument("--state", required=True, action="append")
    r.add_argument("--summary", help="also write {label: {same, n, mean_hit}} as JSON here")
    a = p.parse_args()
    {"start": cmd_start, "next": cmd_next, "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    main()
