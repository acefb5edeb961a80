#!/usr/bin/env python3
"""Put a benchmark's current table into docs/benchmarks.md.

docs/benchmarks.md holds one section per benchmark, between `<!-- bench:NAME -->` and
`<!-- /bench:NAME -->`. The benchmark scripts, run with --write-docs, call

    scripts/bench-docs.py write NAME TABLE_FILE --command "scripts/x.sh ARGS"

which replaces that section (and nothing else in the page) with: the date it was measured (UTC),
the machine (CPUs, CPU model, kernel), the command, and TABLE_FILE's markdown (the table, and
any lines under it). When TABLE_FILE holds `<!-- docs -->` ... `<!-- /docs -->`, only that part
is taken, so a report.md can carry its docs table inline. A NAME the page has no markers for is
an error: the page decides where each benchmark goes.

    scripts/bench-docs.py criterion BENCH [--filter REGEX] [--write-docs]
        runs `cargo bench --bench BENCH` (short measurement), prints a table of the median time
        of each benchmark it ran and, with --write-docs, puts it in section `criterion-BENCH`.

    scripts/bench-docs.py tree-memory [--write-docs] [-- ARGS]
        runs `cargo bench --bench tree_memory [-- ARGS]` (the tree weighed offline on the Mooncake
        traces), prints its table and, with --write-docs, puts it in section `tree-memory`.

    scripts/bench-docs.py --self-test
        checks the writer and the output parsers on synthetic input (no benchmark runs).

The command shown on the page leaves out the options that do not change what is measured
(--write-docs, --docs-section, --skip-build, --out, --no-chart).

Options of `write`: --docs PATH (default docs/benchmarks.md), --date YYYY-MM-DD and
--machine TEXT (default: today, and this machine as read from /proc).
Standard library only.
"""

import datetime
import os
import shlex
import platform
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs", "benchmarks.md")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")


def machine():
    """'2 CPUs (AMD EPYC ...), virtual machine, Linux 6.18.44' from what this process sees."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 0
    model, vm = "unknown CPU", False
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown CPU":
                    model = " ".join(value.split())
                elif key == "flags" and "hypervisor" in value.split():
                    vm = True
    except OSError:
        pass
    return f"{cpus} CPUs ({model}){', virtual machine' if vm else ''}, Linux {platform.release()}"


def table_part(text):
    """The part of a report meant for the docs: between the docs markers, else all of it."""
    m = re.search(r"<!-- docs -->\n?(.*?)<!-- /docs -->", text, re.S)
    body = m.group(1) if m else text
    return body.strip("\n")


def section(name, body, command, date, where):
    return (f"<!-- bench:{name} -->\n"
            f"Measured on {date}, {where}, with\n\n"
            f"```sh\n{command}\n```\n\n"
            f"{body}\n"
            f"<!-- /bench:{name} -->")


def replace_section(page, name, new):
    """`page` with section NAME replaced by `new`; ValueError when its markers are missing."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    i = page.find(start)
    j = page.find(end, i + len(start)) if i >= 0 else -1
    if i < 0 or j < 0:
        raise ValueError(f"no section '{name}' ({start} ... {end}) in the page")
    if page.find(start, i + len(start)) >= 0:
        raise ValueError(f"section '{name}' appears twice in the page")
    return page[:i] + new + page[j + len(end):]


# Options that change where a run writes or whether it builds, not what it measures: left out of
# the command shown (flag -> whether it takes a value).
LOCAL_OPTIONS = {"--write-docs": False, "--docs-section": True, "--skip-build": False, "--out": True,
                 "--no-chart": False}


def shown_command(command):
    """The command as a reader would retype it: one line, without the local options."""
    try:
        words = shlex.split(command)
    except ValueError:
        return " ".join(command.split())
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
            continue
        name = w.split("=", 1)[0]
        if name in LOCAL_OPTIONS:
            skip = LOCAL_OPTIONS[name] and "=" not in w
            continue
        out.append(w)
    return shlex.join(out)


def check_body(body):
    if not body.strip():
        raise ValueError("the table file is empty")
    if "<!-- bench:" in body or "<!-- /bench:" in body:
        raise ValueError("the table file holds section markers of its own")
    if not any(line.startswith("|") for line in body.splitlines()):
        raise ValueError("the table file holds no markdown table")


def write(name, table_text, command, docs=DOCS, date=None, where=None):
    if not NAME_RE.match(name):
        raise ValueError(f"bad section name: {name!r}")
    body = table_part(table_text)
    check_body(body)
    command = shown_command(command)
    date = date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    if not re.match(r"^\d{4}-\d{2}-\d{2}$", date):
        raise ValueError(f"bad date: {date!r}")
    with open(docs, encoding="utf-8") as f:
        page = f.read()
    page = replace_section(page, name, section(name, body, command, date, where or machine()))
    tmp = docs + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(tmp, docs)


# ---- criterion --------------------------------------------------------------------------------
TIME_RE = re.compile(r"time:\s*\[\s*\S+ \S+\s+(\S+) (\S+)\s+\S+ \S+\s*\]")
THRPT_RE = re.compile(r"thrpt:\s*\[\s*\S+ \S+\s+(\S+) (\S+)\s+\S+ \S+\s*\]")


def parse_criterion(text):
    """[(benchmark id, median time, median throughput or '')] from `cargo bench` output."""
    rows, name = [], None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            head = line.split()[0]
            if head not in ("Benchmarking", "Found", "Running", "Gnuplot", "Warning:", "change:",
                            "Performance", "No", "Change", "Compiling", "Finished", "running",
                            "test", "WARNING:"):
                name = head
        m = TIME_RE.search(line)
        if m and name:
            rows.append([name, f"{m.group(1)} {m.group(2)}", ""])
            continue
        m = THRPT_RE.search(line)
        if m and rows and rows[-1][0] == name and not rows[-1][2]:
            rows[-1][2] = f"{m.group(1)} {m.group(2)}"
    return [tuple(r) for r in rows]


def criterion_table(rows):
    thrpt = any(r[2] for r in rows)
    out = ["| benchmark | median time" + (" | median throughput |" if thrpt else " |"),
           "|---|---" + ("|---|" if thrpt else "|")]
    for name, t, tp in rows:
        out.append(f"| `{name}` | {t}" + (f" | {tp or '—'} |" if thrpt else " |"))
    return "\n".join(out)


def criterion(argv):
    import argparse
    ap = argparse.ArgumentParser(prog="bench-docs.py criterion")
    ap.add_argument("bench")
    ap.add_argument("--filter", default="")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--docs", default=DOCS)
    a = ap.parse_args(argv)
    cmd = ["cargo", "bench", "-q", "--bench", a.bench, "--", "--warm-up-time", "1",
           "--measurement-time", "3"] + ([a.filter] if a.filter else [])
    run = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(run.stdout)
    if run.returncode != 0:
        print(f"cargo bench failed ({run.returncode})", file=sys.stderr)
        return 1
    rows = parse_criterion(run.stdout)
    if not rows:
        print("no criterion results in the output", file=sys.stderr)
        return 1
    table = criterion_table(rows)
    print("\n" + table)
    if a.write_docs:
        shown = shlex.join([w for w in cmd if w != "-q"])
        write(f"criterion-{a.bench.replace('_', '-')}", table, shown, docs=a.docs)
        print(f"wrote section criterion-{a.bench.replace('_', '-')} of {os.path.relpath(a.docs, ROOT)}")
    return 0


# ---- tree_memory ------------------------------------------------------------------------------
TREE_RE = re.compile(
    r"^tree_memory (?P<trace>\S+): (?P<prompts>\d+) prompts \((?P<mb>[\d.]+) MB.*?; (?P<nodes>\d+) nodes, "
    r"(?P<edge>\d+) distinct edge bytes \((?P<per>\d+)/node\); per-worker chars .*?\(max (?P<max>\d+) % of 2\^26\); "
    r"heap (?P<req>[\d.]+) MB requested / (?P<round>[\d.]+) MB in size classes; excl\. edge bytes "
    r"(?P<nreq>[\d.]+) B/node requested, (?P<nround>[\d.]+) B/node in size classes \(target <= 100: (?P<verdict>[^)]*)\)")


def tree_memory_table(text):
    rows = []
    for line in text.splitlines():
        m = TREE_RE.match(line.strip())
        if m:
            g = m.groupdict()
            rows.append(f"| {g['trace']} | {int(g['prompts']):,} ({float(g['mb']):.0f} MB) | {int(g['nodes']):,} "
                        f"| {int(g['edge']) / 1e6:.1f} MB ({int(g['per']) / 1e3:.1f} KB/node) | {g['max']} % of 2^26 "
                        f"| {g['req']} / {g['round']} MB | **{g['nreq']} B/node** | {g['nround']} B/node | {g['verdict']} |")
    if not rows:
        return None
    return "\n".join(["| trace | prompts (text) | nodes | distinct edge bytes | max per-worker chars "
                      "| heap requested / in size classes | beyond edge text, requested | in size classes "
                      "| target ≤ 100 B/node |",
                      "|---|---|---|---|---|---|---|---|---|"] + rows)


def tree_memory(argv):
    write_docs = "--write-docs" in argv
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    cmd = ["cargo", "bench", "-q", "--bench", "tree_memory"] + (["--"] + rest if rest else [])
    run = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(run.stdout)
    table = tree_memory_table(run.stdout) if run.returncode == 0 else None
    if not table:
        print("no tree_memory results (cargo bench failed, or no trace was found)", file=sys.stderr)
        return 1
    print("\n" + table)
    if write_docs:
        write("tree-memory", table, shlex.join(cmd[:2] + cmd[3:]))
        print("wrote section tree-memory of docs/benchmarks.md")
    return 0


# ---- self-test --------------------------------------------------------------------------------
def self_test():
    page = ("# Benchmarks\n\nintro\n\n## A\n\n<!-- bench:alpha -->\nold alpha\n<!-- /bench:alpha -->\n\n"
            "text between\n\n## B\n\n<!-- bench:beta -->\nold beta\n<!-- /bench:beta -->\n\ntail\n")
    report = ("# report\n\nlong details\n\n<!-- docs -->\n| x | y |\n|---|---|\n| 1 | 2 |\n\nnote under it\n"
              "<!-- /docs -->\n\nmore details\n")
    with tempfile.TemporaryDirectory() as d:
        docs = os.path.join(d, "benchmarks.md")
        with open(docs, "w") as f:
            f.write(page)
        write("alpha", report, "scripts/a.sh  --x 1\n--y --write-docs --out /tmp/r --skip-build", docs=docs, date="2030-01-02", where="2 CPUs (test)")
        got = open(docs).read()
        want = page.replace("<!-- bench:alpha -->\nold alpha\n<!-- /bench:alpha -->",
                            "<!-- bench:alpha -->\nMeasured on 2030-01-02, 2 CPUs (test), with\n\n"
                            "```sh\nscripts/a.sh --x 1 --y\n```\n\n| x | y |\n|---|---|\n| 1 | 2 |\n\n"
                            "note under it\n<!-- /bench:alpha -->")
        assert got == want, f"section not replaced as expected:\n{got}"
        # Writing again replaces, never stacks: the page holds only the latest table.
        write("alpha", "| z |\n|---|\n| 3 |\n", "scripts/a.sh", docs=docs, date="2030-01-03", where="w")
        got2 = open(docs).read()
        assert got2.count("<!-- bench:alpha -->") == 1 and "| 1 | 2 |" not in got2 and "| 3 |" in got2, got2
        assert "old beta" in got2 and "text between" in got2 and got2.endswith("tail\n"), got2
        # A whole file without markers is taken whole.
        write("beta", "| b |\n|---|\n| 4 |\n", "x", docs=docs, date="2030-01-04", where="w")
        assert "| 4 |" in open(docs).read() and "old beta" not in open(docs).read()
        for bad, args in [("no section", ("gamma", "| a |\n|---|\n", "x")),
                          ("no table", ("alpha", "just words\n", "x")),
                          ("empty", ("alpha", "<!-- docs --><!-- /docs -->", "x")),
                          ("markers in body", ("alpha", "| a |\n<!-- /bench:beta -->\n", "x")),
                          ("bad name", ("Alpha Beta", "| a |\n", "x"))]:
            before = open(docs).read()
            try:
                write(*args, docs=docs, date="2030-01-05", where="w")
            except ValueError:
                assert open(docs).read() == before, f"{bad}: the page changed on error"
            else:
                raise AssertionError(f"{bad}: accepted")
        try:
            write("alpha", "| a |\n|---|\n", "x", docs=docs, date="yesterday", where="w")
            raise AssertionError("bad date accepted")
        except ValueError:
            pass
    assert re.match(r"^\d+ CPUs \(.*\).*, Linux ", machine()), machine()
    assert shown_command("scripts/x.sh --sim-args 'a b' --docs-section s1 --out=/r 3") == \
        "scripts/x.sh --sim-args 'a b' 3", shown_command("scripts/x.sh --sim-args 'a b' --docs-section s1 --out=/r 3")
    sample = """\
Benchmarking chat/cold_4k: Warming up for 1.0000 s
chat/cold_4k            time:   [755.10 µs 762.40 µs 770.02 µs]
                        thrpt:  [5.3127 Melem/s 5.3659 Melem/s 5.4177 Melem/s]
                 change: [-1.2% +0.3% +1.9%] (p = 0.71 > 0.05)
Found 3 outliers among 100 measurements (3.00%)
kv_index/apply/stored_16x64+publish
                        time:   [110.12 µs 114.20 µs 118.91 µs]
"""
    rows = parse_criterion(sample)
    assert rows == [("chat/cold_4k", "762.40 µs", "5.3659 Melem/s"),
                    ("kv_index/apply/stored_16x64+publish", "114.20 µs", "")], rows
    t = criterion_table(rows)
    assert "| `chat/cold_4k` | 762.40 µs | 5.3659 Melem/s |" in t and "| — |" in t, t
    line = ("tree_memory conversation: 12031 prompts (579.0 MB, 61.2 % matched, 9000 routed to a holder) over 8 "
            "workers in 3.1 s; 19084 nodes, 362700000 distinct edge bytes (19005/node); per-worker chars "
            "0:46.5M 1:46.8M (max 70 % of 2^26); heap 364.6 MB requested / 399.6 MB in size classes; excl. edge "
            "bytes 96.1 B/node requested, 1930.0 B/node in size classes (target <= 100: met as requested, not in "
            "size classes); size-class slack 9.7 % of edge bytes")
    t = tree_memory_table("noise\n" + line + "\n")
    assert t and "| conversation | 12,031 (579 MB) | 19,084 | 362.7 MB (19.0 KB/node) | 70 % of 2^26 " \
        "| 364.6 / 399.6 MB | **96.1 B/node** | 1930.0 B/node | met as requested, not in size classes |" in t, t
    assert tree_memory_table("tree_memory x: skipped: not found") is None
    print("bench-docs.py self-test: ok")
    return 0


def main(argv):
    if argv[:1] == ["--self-test"]:
        return self_test()
    if argv[:1] == ["criterion"]:
        return criterion(argv[1:])
    if argv[:1] == ["tree-memory"]:
        return tree_memory(argv[1:])
    if argv[:1] == ["write"]:
        import argparse
        ap = argparse.ArgumentParser(prog="bench-docs.py write")
        ap.add_argument("name")
        ap.add_argument("table_file")
        ap.add_argument("--command", required=True)
        ap.add_argument("--docs", default=DOCS)
        ap.add_argument("--date")
        ap.add_argument("--machine")
        a = ap.parse_args(argv[1:])
        try:
            with open(a.table_file, encoding="utf-8") as f:
                text = f.read()
            write(a.name, text, a.command, docs=a.docs, date=a.date, where=a.machine)
        except (OSError, ValueError) as e:
            print(f"bench-docs.py: {e}", file=sys.stderr)
            return 1
        print(f"wrote section {a.name} of {os.path.relpath(a.docs, ROOT)}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
