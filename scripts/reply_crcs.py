"""Print each run's reply CRC from `strata bench --json` files and say whether all agree
(greedy runs of configurations that must compute the same tokens): `python3
scripts/reply_crcs.py FILE.json...`."""

from __future__ import annotations

import json
import sys


def main(paths: list[str]) -> int:
    crcs = set()
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for scenario, rows in data.items():
            rows = json.loads(rows) if isinstance(rows, str) else rows
            for row in rows:
                for s in row["samples"]:
                    crcs.add(s["reply_crc"])
                    print(f"{path}: {scenario} / {row['label']}: reply {s['reply_crc']} "
                          f"({s['generated']} tokens)")
    print("replies: all equal" if len(crcs) == 1 else f"replies: {len(crcs)} different")
    return 0 if len(crcs) == 1 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
