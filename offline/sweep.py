"""`tokenloom sweep KEY VALUES`: the seed's operating-point search, one config key at a time.

The same request set runs at each value of one config key (e.g. kv_cache.gpu_memory_utilization
0.60:0.95:0.05, kv_cache.block_size 8,16,32, quantization.method none,int8,int4); peak memory,
TTFT, TPOT and throughput are written to a CSV and drawn in a PNG, and the best operating point
(highest throughput; ties to lower memory) is named.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from tokenloom.engine.config import EngineConfig
from tokenloom.offline.operating_point import OperatingPoint, RequestSet, measure

COLUMNS = (
    "value",
    "peak_memory_gib",
    "weight_mib",
    "kv_pool_gib",
    "ttft_p50_s",
    "tpot_p50_s",
    "throughput_tok_s",
    "wall_s",
    "preemptions",
)


@dataclass(slots=True)
class SweepRow:
    value: object
    point: OperatingPoint | None
    error: str | None = None  # the configuration could not run (e.g. KV cache too small)

    def as_dict(self) -> dict:
        values: dict[str, object] = {c: "" for c in COLUMNS}
        values["value"] = _label(self.value)
        if self.point is not None:
            for column in COLUMNS[1:]:
                number = getattr(self.point, column)
                values[column] = round(number, 6) if isinstance(number, float) else number
        values["error"] = self.error or ""
        return values


def apply(config: EngineConfig, key: str, value) -> EngineConfig:
    section, name = key.split(".", 1)
    if key == "quantization.method":
        if value == "none":
            return config.replace("quantization", enabled=False)
        return config.replace("quantization", enabled=True, method=value)
    return config.replace(section, **{name: value})


def run_sweep(config: EngineConfig, key: str, values: list, requests: RequestSet, on_row=None) -> list[SweepRow]:
    rows = []
    for value in values:
        try:
            row = SweepRow(value, measure(apply(config, key, value), requests))
        except Exception as exc:  # one value that cannot run (too little KV memory...) is a row, not a crash
            row = SweepRow(value, None, f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def best(rows: list[SweepRow]) -> SweepRow | None:
    ok = [(r, r.point) for r in rows if r.point is not None]
    top = max(ok, key=lambda rp: (rp[1].throughput_tok_s, -rp[1].peak_memory_gib), default=None)
    return None if top is None else top[0]


def write_csv(rows: list[SweepRow], path: Path) -> None:
    with open(path, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=[*COLUMNS, "error"])
        writer.writeheader()
        for row in rows:
            writer.writerow(row.as_dict())


def write_chart(rows: list[SweepRow], key: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.point is not None]
    numeric = all(isinstance(r.value, (int, float)) and not isinstance(r.value, bool) for r in ok)
    xs = [r.value if numeric else i for i, r in enumerate(ok)]
    panels = (
        ("peak_memory_gib", "peak memory (GiB)"),
        ("ttft_p50_s", "TTFT p50 (s)"),
        ("tpot_p50_s", "TPOT p50 (s)"),
        ("throughput_tok_s", "throughput (output tok/s)"),
    )
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    for ax, (column, label) in zip(axes.flat, panels):
        ax.plot(xs, [getattr(r.point, column) for r in ok], marker="o")
        ax.set_xlabel(key)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if not numeric:
            ax.set_xticks(xs, [_label(r.value) for r in ok])
    top = best(rows)
    if top is not None:
        x = top.value if numeric else ok.index(top)
        axes.flat[3].axvline(x, color="tab:green", linestyle="--", label=f"best: {_label(top.value)}")
        axes.flat[3].legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_table(rows: list[SweepRow], key: str) -> str:
    lines = [
        f"| {key} | peak mem GiB | weights MiB | TTFT p50 s | TPOT p50 ms | tok/s | preemptions |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        p = row.point
        if p is None:
            lines.append(f"| {_label(row.value)} | failed: {row.error} | | | | | |")
            continue
        lines.append(
            f"| {_label(row.value)} | {p.peak_memory_gib:.3f} | {p.weight_mib:,.1f} | {p.ttft_p50_s:.3f} | "
            f"{p.tpot_p50_s * 1000:.1f} | {p.throughput_tok_s:,.1f} | {p.preemptions} |"
        )
    return "\n".join(lines)


def _label(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
