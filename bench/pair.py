"""``pipeline bench pair``: one change's effect on the plumbing's cost, as a ratio measured
in one run. Two sides, A (before) and B (after), each the capacity bench's delta-latency
point (256 streams by default, SIMULATED engine) run with its own environment and, if given, its
own checkout of the code. One unrecorded point warms the broker first; then the pairs,
one side after the other on the same broker, in the order A B, B A, A B, ... so that a
host drifting the same way all along favours neither side.

What a pair tells: each component's CPU per token, B over A, and the delta -> client
latency. The host's speed drifts between runs as much as a small change moves them,
which is why the load generator, which no change to the pipeline touches, is reported
too: a ratio no larger than its own is noise.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.capacity import COMPONENTS, delta_latency, total_per_token

STREAMS = 256
# µs per token, then ms.
FIGURES = (*COMPONENTS, "total", "load generator", "p50 ms", "p99 ms", "hop p99 ms",
           "transactions/s", "live records/s", "gateway transactions/s", "ttft p50 ms")


@dataclass(frozen=True)
class Side:
    name: str  # "A" or "B"
    env: dict[str, str] = field(default_factory=dict)
    tree: Path | None = None
    python: Path | None = None  # the interpreter its processes run (None: this one)

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in sorted(self.env.items())]
        tree = self.tree or Path.cwd()  # the stack's processes run from the current folder
        where = "the code" if self.tree is None else f"the code in {self.tree}"
        return ", ".join([f"{where} ({checkout(tree)})", interpreter(self.python), *parts])


def interpreter(python: Path | None) -> str:
    """Which Python ``python`` (None: this process's) is: its version and executable."""
    done = subprocess.run([str(python or sys.executable), "-c", "import platform, sys; "
                           "print(platform.python_version(), sys.executable)"],
                          capture_output=True, text=True)
    return f"Python {done.stdout.strip() or '?'}"


def checkout(tree: Path) -> str:
    """Which commit ``tree`` holds, and the files it changed since, if any."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
        return done.stdout.rstrip("\n") if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "not a git checkout"
    changed = [line[3:] for line in git("status", "--porcelain").splitlines()]
    return commit + (f" with changes to {', '.join(changed)}" if changed else "")


def order(pairs: int) -> list[str]:
    """A B, B A, A B, ...: the sides' order in each pair, alternating."""
    return [side for i in range(pairs) for side in (("A", "B") if i % 2 == 0 else ("B", "A"))]


def figures(point: dict[str, Any]) -> dict[str, float]:
    """One run's figures: µs per token for each component and the total, latency in ms,
    the worker's and the gateway's transactions per second, and the clients' TTFT."""
    per = point["cpu_us_per_token"]
    return {**{name: per.get(name, 0.0) for name in COMPONENTS},
            "total": total_per_token(point), "load generator": per.get("load generator", 0.0),
            "p50 ms": point["ms"]["p50"], "p99 ms": point["ms"]["p99"],
            "hop p99 ms": point["kafka_hop_ms"]["p99"],
            "transactions/s": point["transactions_per_s"],
            "live records/s": point["live_records_per_s"],
            "gateway transactions/s": point["gateway_transactions_per_s"],
            "ttft p50 ms": point["ttft_ms"]["p50"]}


def summarise(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per figure: each side's median and the median, least and most of the pairs' B / A
    ratios. ``runs``: in the order run, each ``{"side", "pair", "figures"}``."""
    by_pair: dict[int, dict[str, dict[str, float]]] = {}
    for run in runs:
        by_pair.setdefault(run["pair"], {})[run["side"]] = run["figures"]
    whole = [p for p in by_pair.values() if {"A", "B"} <= set(p)]
    out = {}
    for name in FIGURES:
        ratios = [p["B"][name] / p["A"][name] for p in whole if p["A"][name]]
        out[name] = {
            "A": statistics.median(p["A"][name] for p in whole) if whole else float("nan"),
            "B": statistics.median(p["B"][name] for p in whole) if whole else float("nan"),
            "ratio": statistics.median(ratios) if ratios else float("nan"),
            "least": min(ratios, default=float("nan")),
            "most": max(ratios, default=float("nan"))}
    return out


def table(summary: dict[str, dict[str, float]]) -> str:
    out = ["| figure | A (median) | B (median) | B / A, median of pairs (least - most) |",
           "|---|---|---|---|"]
    for name, row in summary.items():
        unit = "" if name.endswith(("ms", "/s")) else " µs/token"
        out.append(f"| {name}{unit} | {row['A']:,.1f} | {row['B']:,.1f} | "
                   f"{row['ratio']:.2f}x ({row['least']:.2f} - {row['most']:.2f}) |")
    return "\n".join(out)


def run(bootstrap: str, log_dir: Path, a: Side, b: Side, *, rate: float, pairs: int,
        rounds: int, streams: int = STREAMS) -> dict[str, Any]:
    sides = {"A": a, "B": b}
    print(f"warming the broker (one unrecorded point, side A) at {streams} x {rate:g}",
          flush=True)
    delta_latency(bootstrap, log_dir, streams, 1, rate, a.tree, a.env, a.python)
    runs: list[dict[str, Any]] = []
    sequence = order(pairs)
    for i, name in enumerate(sequence):
        side = sides[name]
        point = delta_latency(bootstrap, log_dir, streams, rounds, rate, side.tree, side.env,
                              side.python)
        run_figures = figures(point)
        runs.append({"side": name, "pair": i // 2, "figures": run_figures,
                     "intact": point["intact"], "replies": point["replies"],
                     "failures": point["failures"]})
        print(f"[{i + 1}/{len(sequence)}] {name}: total {run_figures['total']:.0f} µs/token "
              f"(broker {run_figures['kafka broker']:.0f}, gateway {run_figures['gateway']:.0f},"
              f" worker {run_figures['worker']:.0f}, load generator "
              f"{run_figures['load generator']:.0f}); p50 / p99 {run_figures['p50 ms']:.1f} / "
              f"{run_figures['p99 ms']:.1f} ms; {point['intact']} of {point['replies']} replies "
              "intact", flush=True)
    return {"streams": streams, "tokens_per_s_per_stream": rate, "rounds": rounds,
            "sides": {n: s.describe() for n, s in sides.items()}, "runs": runs,
            "summary": summarise(runs)}


def report(result: dict[str, Any]) -> str:
    intact = all(r["intact"] == r["replies"] and not r["failures"] for r in result["runs"])
    return (f"A: {result['sides']['A']}\n\nB: {result['sides']['B']}\n\n"
            f"{len(result['runs']) // 2} pairs of the {result['streams']} x "
            f"{result['tokens_per_s_per_stream']:g} point ({result['rounds']} rounds each), "
            f"SIMULATED engine; every reply intact in every run: {'yes' if intact else 'NO'}."
            f"\n\n{table(result['summary'])}")
