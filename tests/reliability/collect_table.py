"""Turn the `RELIABILITY|...` and `LOAD|...` lines of a `pytest -s tests/reliability` run into the
Markdown tables of docs/reliability.md (tests/reliability/report.py prints them).

    python -m pytest -s -p no:cacheprovider tests/reliability | tee run.log
    python -m tests.reliability.collect_table < run.log
"""

from __future__ import annotations

import sys

HEADER = (
    "| scenario | jobs submitted | jobs finished | duplicates | lost | max recovery time (s) | recovery measured as |\n"
    "| --- | ---: | ---: | ---: | ---: | ---: | --- |"
)


def main(lines) -> None:
    rows, loads = [], []
    for line in lines:
        line = line.strip()
        if line.startswith("RELIABILITY|"):
            rows.append("| " + " | ".join(line.split("|")[1:]) + " |")
        elif line.startswith("LOAD|"):
            loads.append("| " + " | ".join(line.split("|")[1:]) + " |")
    print(HEADER)
    print("\n".join(rows))
    if loads:
        print(
            "\n| load | streams | rate | errors | 429s | p50 TTFT | p99 TTFT | API RSS | worker RSS |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"
        )
        print("\n".join(loads))


if __name__ == "__main__":
    main(sys.stdin)
