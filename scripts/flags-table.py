#!/usr/bin/env python3
"""Render the README's flag table from `radixgate --help` (keeps README true to the code).

Usage: target/release/radixgate --help | scripts/flags-table.py            # print the table
       target/release/radixgate --help | scripts/flags-table.py --write README.md
           # replace the table between `<!-- flags -->` and `<!-- /flags -->` in README.md

tests/docs.rs checks that the README has a row for every flag with its default.
"""
import re
import sys


def table(txt):
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
        # clap's long help lists an enum's values with their docs; the description names them.
        rest = re.split(r"\n\s*Possible values:", rest)[0]
        desc = re.sub(r"\s*\[(default|env|aliases?|possible values): [^\]]*\]", "", rest)
        desc = " ".join(desc.split()).replace("|", "\\|")
        default = "`" + d.group(1) + "`" if d else "—"
        rows.append("| `%s` | %s | %s |" % (flag, default, desc))
    return "\n".join(["| flag | default | what it does |", "|---|---|---|"] + rows)


def main(argv):
    out = table(sys.stdin.read())
    if argv[:1] == ["--write"] and len(argv) == 2:
        path = argv[1]
        text = open(path, encoding="utf-8").read()
        start, end = "<!-- flags -->\n", "\n<!-- /flags -->"
        i, j = text.find(start), text.find(end)
        if i < 0 or j < i:
            print(f"{path} has no {start.strip()} ... {end.strip()} markers", file=sys.stderr)
            return 1
        with open(path, "w", encoding="utf-8") as f:
            f.write(text[:i + len(start)] + out + text[j:])
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
