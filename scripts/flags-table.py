#!/usr/bin/env python3
"""Render the README's flag table from `radixgate --help` (keeps README true to the code).

Usage: target/release/radixgate --help | scripts/flags-table.py
"""
import re
import sys

txt = sys.stdin.read()
blocks = re.split(r"\n(?=      --|  -)", txt)
rows = []
for b in blocks:
    m = re.match(r"\s*(?:-\w, )?(--[\w-]+)(?: <[^>]+>(?:\.\.\.)?| \[<[^>]+>\.\.\.\])?\s*\n(.*)", b, re.S)
    if not m:
        continue
    flag, rest = m.group(1), m.group(2)
    if flag in ("--help", "--version"):
        continue
    d = re.search(r"\[default: ([^\]]*)\]", rest)
    desc = re.sub(r"\s*\[(default|env|aliases?|possible values): [^\]]*\]", "", rest)
    desc = " ".join(desc.split()).replace("|", "\\|")
    default = "`" + d.group(1) + "`" if d else "—"
    rows.append("| `%s` | %s | %s |" % (flag, default, desc))
print("| flag | default | what it does |")
print("|---|---|---|")
print("\n".join(rows))
