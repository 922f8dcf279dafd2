"""Set two emulated-cluster runs side by side: the executor posting every message at once against one
operation at a time per device, per case and approach, with each order's own model and the byte bound.

    .venv/bin/python -m bench.netlab.summary bench/results/netlab-posted-500.json bench/results/netlab-device-500.json

Prints the comparison as Markdown (BENCHMARKS.md itself is made by `bench/benchmarks_doc.py`).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import click

from .cli import options, parse
from .experiments import APPROACHES

MODEL = {"posted": "posted", "device": "device-order"}
PAPER = {  # the paper's measured speed-up of its system over Alpa (section 6), by case
    "case1": "~1x", "case2": "~1x", "case5": "~1x", "case6": "~1x", "case7": "up to 2.5x", "case8": "up to 2.5x",
    "case3": "3-10x", "case4": "3-10x", "case9": "3-10x",
}


def _rows(path: Path) -> tuple[dict, dict[tuple[str, float, str], dict]]:
    data = json.loads(path.read_text())
    order = data["meta"].get("order", "posted")
    rows = {(run["case"], run["rate_mbit"], r["approach"]): r | {"checked": run["checked"], "order": run.get("order", order)}
            for run in data["runs"] for r in run["rows"]}
    return data["meta"] | {"order": order, "runs": data["runs"]}, rows


def _links(runs: list[tuple[dict, dict]]) -> str:
    """Per launch: the links' bytes over the plans' (every approach of a case runs in one launch), and TCP retransmits."""
    lines = ["| case | Mbit/s | order | latency us | overhead us | link bytes / plan bytes | TCP retransmits | every shard bit-exact |",
             "|---|---|---|---|---|---|---|---|"]
    for meta, _ in runs:
        for run in meta["runs"]:
            plan = sum(h["predicted_sent"] + h["predicted_received"] for h in run["links"])
            link = sum(h["sent"] + h["received"] for h in run["links"])
            lines.append(f"| {run['case']} | {run['rate_mbit']:g} | {meta['order']} | {run.get('latency_us') or '-'} | {run.get('overhead_us') or '-'} | "
                         f"{link / plan:.4f} | {sum(run.get('retransmitted_segments', {}).values())} | "
                         f"{'yes' if run['checked'] else 'NO'} |")
    return "\n".join(lines)


def _f(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def summary(paths: list[Path], title: str = "Emulated cluster: executor order") -> str:
    title_flag = "" if title == "Emulated cluster: executor order" else f" --title '{title}'"
    runs = [_rows(p) for p in paths]
    orders = [meta["order"] for meta, _ in runs]
    place = {label: i for i, (label, _, _) in enumerate(APPROACHES)}
    keys = sorted({k for _, rows in runs for k in rows}, key=lambda k: (k[1], k[0], place.get(k[2], len(place)), k[2]))
    head = ["case", "Mbit/s", "approach"] + [f"{o} ms" for o in orders] + [f"{o}: meas/model" for o in orders] + \
        [f"{o}: meas/bound" for o in orders]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    errors = {o: [] for o in orders}
    for key in keys:
        cells, ratios, bounds = [], [], []
        for (meta, rows), order in zip(runs, orders):
            r = rows.get(key)
            m = r["measured_s"] if r else None
            cells.append(_f(m * 1e3 if m is not None else None, 0))
            model = r["predicted_s"][MODEL[r["order"]]] if r else None  # the order each row ran in (a run's rows may say their own)
            ratios.append(_f(m / model if m and model else None))
            bounds.append(_f(m / r["predicted_s"]["lower-bound"] if m and r else None))
            if m and model and not (r or {}).get("same_as"):  # a plan run once counts once
                errors[order].append(m / model)
        same = next((r["same_as"] for _, rows in runs if (r := rows.get(key)) and r.get("same_as")), None)
        label = key[2] + (f" (= {same})" if same else "")
        lines.append(f"| {key[0]} | {key[1]:g} | {label} | " + " | ".join(cells + ratios + bounds) + " |")
    facts = []
    for order, values in errors.items():
        if values:
            within = sum(abs(v - 1) <= 0.10 for v in values)
            facts.append(f"- `{order}`: measured / its model, median {statistics.median(values):.2f}, range "
                         f"{min(values):.2f}-{max(values):.2f}; within 10% for {within} of {len(values)} runs.")
    speedups = []
    for case in sorted({k[0] for k in keys}):
        for rate in sorted({k[1] for k in keys}):
            for (meta, rows), order in zip(runs, orders):
                ours = rows.get((case, rate, "ours"))
                if not ours or not ours["measured_s"]:
                    continue
                others = {a: rows[(case, rate, a)]["measured_s"] for a in ("naive", "alpa-send-recv", "alpa-allgather")
                          if (case, rate, a) in rows and rows[(case, rate, a)]["measured_s"]}
                vs = ", ".join(f"{a} {t / ours['measured_s']:.2f}x" for a, t in others.items())
                speedups.append(f"| {case} | {rate:g} | {order} | {vs} | {PAPER.get(case, '-')} |")
    commands = "\n".join(f"    {meta['command']}" for meta, _ in runs)
    loads = ", ".join(f"{meta['order']}: {meta['loadavg_after'][0]:.1f}" for meta, _ in runs)
    return (f"Made by (as root, one launch per case and rate; load average after each run: {loads}, "
            f"{runs[0][0]['cpus']} cores):\n\n{commands}\n    .venv/bin/python -m bench.netlab.summary "
            + " ".join(str(p) for p in paths) + title_flag + "\n\n" + "\n".join(lines) + "\n\n" + "\n".join(facts)
            + "\n\nOurs measured against the others (their time over ours), next to the paper's speed-up over Alpa:\n\n"
            + "| case | Mbit/s | executor order | others / ours | paper |\n|---|---|---|---|---|\n" + "\n".join(speedups)
            + "\n\nBytes on the links against the plans' bytes crossing each host's NIC (all hosts, both ways):\n\n"
            + _links(runs) + "\n")


def compact(paths: list[Path]) -> str:
    """One row per case and rate: ours measured against the byte bound and its own model, the others'
    measured time over ours, and how many distinct plans of the launch came within 10% of their model."""
    lines = ["| case | Mbit/s | order | ours ms | ours / bound | ours / model | naive / ours | Alpa send/recv / ours | "
             "Alpa all-gather / ours | plans within 10% of model | worst plan / model | link bytes / plan bytes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    within = total = 0
    for meta, rows in (_rows(p) for p in paths):
        for run in meta["runs"]:
            by = {r["approach"]: r for r in run["rows"] if r["measured_s"]}
            ours = by.get("ours")
            if not ours:
                continue
            model = MODEL[run.get("order", meta["order"])]
            fits = [(r["measured_s"] / r["predicted_s"][model], r["approach"]) for r in by.values() if not r.get("same_as")]
            good = sum(abs(q - 1) <= 0.10 for q, _ in fits)
            within, total = within + good, total + len(fits)
            worst = max(fits, key=lambda f: abs(f[0] - 1))
            other = [_f(by[a]["measured_s"] / ours["measured_s"]) if a in by else "-" for a in ("naive", "alpa-send-recv", "alpa-allgather")]
            plan = sum(h["predicted_sent"] + h["predicted_received"] for h in run["links"])
            link = sum(h["sent"] + h["received"] for h in run["links"])
            lines.append(f"| {run['case']} | {run['rate_mbit']:g} | {meta['order']} | {ours['measured_s'] * 1e3:.0f} | "
                         f"{ours['measured_s'] / ours['predicted_s']['lower-bound']:.3f} | {ours['measured_s'] / ours['predicted_s'][model]:.2f} | "
                         + " | ".join(other) + f" | {good} of {len(fits)} | {worst[1]} {worst[0]:.2f} | {link / plan:.4f} |")
    commands = "\n".join(f"    {meta['command']}" for meta, _ in (_rows(p) for p in paths))
    loads = ", ".join(_load(_rows(p)[0]) for p in paths)
    return (f"Made by (as root, one launch per case and rate; load average after each run: {loads}):\n\n{commands}\n"
            f"    .venv/bin/python -m bench.netlab.summary --compact " + " ".join(str(p) for p in paths)
            + f"\n\n" + "\n".join(lines) + f"\n\nDistinct plans within 10% of their model: {within} of {total}.\n")


def _load(meta: dict) -> str:
    """The load average after a launch, or what a results file still being written (or cut short) says instead."""
    load = meta.get("loadavg_after")
    return f"{load[0]:.1f}" if load else "- (the launch had not finished)"


@click.argument("results", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--print", "print_", is_flag=True, help="print the comparison (what it always does)")
@click.option("--title", default="Emulated cluster: executor order", show_default=True, help="the heading printed above the comparison")
@click.option("--compact", is_flag=True, help="one row per case and rate")
@options
def _command(**_):
    """Set emulated-cluster runs side by side (RESULTS: results JSON files of bench.netlab.experiments)."""


def main(argv=None) -> int:
    args = parse(_command, argv, "python -m bench.netlab.summary")
    if args.compact:
        print(compact(args.results))
        return 0
    print(f"## {args.title}\n\n{summary(args.results, args.title)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
