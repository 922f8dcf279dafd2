"""Make BENCHMARKS.md from the results files in bench/results/: one section per question, one table each.

    .venv/bin/python bench/benchmarks_doc.py            # rewrite BENCHMARKS.md (`make benchmarks-doc`)
    .venv/bin/python bench/benchmarks_doc.py --check    # exit 1 if BENCHMARKS.md is not what the results make

Every figure in the tables is read from a results JSON (written by a `bench/bench_*.py` or by
`bench.netlab.experiments`); the prose around them says what was run, where, and what each column
means, and changes only here. `tests/test_benchmarks_doc.py` fails when the committed BENCHMARKS.md
differs from this script's output, so the document cannot drift from its results. Results that no
table reads live in `bench/results/archive/`.
"""

from __future__ import annotations

import difflib
import json
import re
import statistics
import sys
from pathlib import Path

import click
from tabulate import tabulate

from xmesh_plan.planner.unit_tasks import DEFAULT_MAX_TASKS

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "BENCHMARKS.md"

# The paper's reference cases by layout (planner/reference_cases.py), so a table row says what it moves.
LAYOUTS = {
    "case1": "2x4 S0 R R -> 2x4 S0 R R", "case2": "2x4 R R R -> 2x4 S0 R R", "case3": "2x4 R S0 R -> 2x4 S0 R R",
    "case4": "2x4 R S01 R -> 2x4 S01 R R", "case5": "2x4 S1 R R -> 2x4 S0 R R", "case6": "2x4 S0 R R -> 3x4 S0 R R",
    "case7": "1x4 S1 R R -> 2x4 R R R", "case8": "2x3 R R R -> 3x2 R R R", "case9": "2x4 R S0 R -> 2x4 R R S0",
    **{f"one_to_{m}": f"1x1 R R R -> {m} R R R" for m in ("1x1", "1x2", "1x3", "1x4", "2x2", "3x2", "4x2")},
}
DEV_MACHINE = ("the development machine: 2 CPU cores shared with other jobs, no GPU, Python 3.11, MPICH from the "
               "`mpich` wheel over shared memory, torch 2.13 (CPU build) with gloo")


def load(name: str):
    return json.loads((RESULTS / name).read_text())


def table(rows: list[list], headers: list[str], align: str) -> str:
    """A GitHub markdown table; `align` has one letter per column: l(eft) or r(ight)."""
    colalign = ["left" if a == "l" else "right" for a in align]
    return tabulate(rows, headers=headers, tablefmt="pipe", colalign=colalign, disable_numparse=True)


def x(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}x"


def runnable(text: str) -> str:
    """A recorded command as it runs now: `python -m bench.<name>` from the repository root, no PYTHONPATH."""
    return re.sub(r"(python3?) bench/(\w+)\.py", r"\1 -m bench.\2", text.replace("PYTHONPATH=$PWD ", ""))


def command(text: str, out: str | None = None) -> str:
    """A results file's command as a fenced block, as it runs now: `--out` named as the file is named now, a
    benchmark run as a module of the bench package from the repository root (`python -m bench.<name>`)."""
    text = runnable(text)
    if out is not None:
        text = re.sub(r"--out \S+", f"--out {out}", text)
    text = text.replace(" --no-markdown", "")
    return f"```\n{text}\n```"


# ---- metrics, defined once ---------------------------------------------------------------------------------------

INTRO = """\
# Benchmarks

What the planner and the executor achieve, one section per question. Every table is generated from the
results files in `bench/results/` by `bench/benchmarks_doc.py` (`make benchmarks-doc`), and a test checks that
this file is what the script makes of them, so a table always shows the results file next to it. Each section
names the environment and the command that wrote its results file; run the command, then `make benchmarks-doc`.
Results files no table reads are kept in `bench/results/archive/`.

1. [Paper cases, held against the bound](#paper-cases-held-against-the-bound)
2. [Weight sync](#weight-sync)
3. [Scale](#scale)
4. [Frontier scale](#frontier-scale)
5. [Executor overhead](#executor-overhead)
6. [Emulated cluster, measured against the model](#emulated-cluster-measured-against-the-model)
7. [Pipelines](#pipelines)

## Metrics

Each column name below means the same in every table.

- **predicted s**: the time the network simulator (`planner/simulate.py`) gives a plan on the problem's
  cluster: every message crosses the links of its route, concurrent messages share a link max-min fairly, a
  message pays a latency (a delay other messages overlap, 20 us by default) and an overhead (time its link is
  busy, 1 us by default). The reference cluster is the paper's: 4 devices per host at 800 Gbit/s inside a
  host, one 10 Gbit/s NIC per host. A prediction is a model, not a measurement.
- **host order, device order, posted**: the three ways the simulator queues a plan's operations
  (`xmesh-plan inspect PLAN --orders`). Host order: each NIC side carries its operations one at a time in the
  plan's order (the plan's own claim, `predicted_seconds`). Device order: each device takes part in one
  operation at a time (the executor's default order for one tensor, and NCCL's). Posted: every operation
  starts once its data is there and all share the links (the MPI executor's default for a multi-tensor plan).
- **bound** (lower bound, byte bound): the bytes the busiest NIC side must carry over its rate
  (`planner/bounds.py`); no plan can be faster. **/ bound** is a time over that bound (1.00x is optimal).
- **X / ours** (a baseline over ours): the baseline's time over ours in the same run; above 1 ours is faster.
- **Alpa send/recv, Alpa all-gather**: Alpa's two cross-mesh approaches as plans (`planner/baselines.py`):
  a send/recv per device pair with its least-loaded sender, and a send to one host-local sharding followed
  by an all-gather inside the host, each device working in Alpa's loop order.
- **naive, size, randomized-greedy, ...**: our broadcast strategy ordered by the paper's solvers;
  **ours** is the default (`auto` solver); **winner** is the solver `auto` kept.
- **compile s**: wall clock of `compile_plan` (cutting, costing, scheduling, simulating); noisy on a shared machine.
- **measured ms**: the median over the timed reshards of the slowest rank's time, on real processes.
- **within 10%**: |measured / model - 1| <= 0.10; a plan two approaches share counts once.
- **peak RSS MiB**: the process's high-water resident memory.
"""


# ---- 1. paper cases ----------------------------------------------------------------------------------------------

def paper_cases() -> str:
    data = load("resharding.json")
    rows = []
    for r in data["cases"]:
        ours = r["ours"]
        rows.append([r["case"], LAYOUTS.get(r["case"], "-"), r["tasks"], f"{r['alpa_send_recv']:.3f}", f"{r['alpa_allgather']:.3f}",
                     f"{r['broadcast_naive']:.3f}", f"{r['broadcast_size']:.3f}", f"{r['broadcast_randomized-greedy']:.3f}",
                     f"**{ours:.3f}**", f"{ours / r['lower_bound']:.4f}", x(r["alpa_send_recv"] / ours), x(r["alpa_allgather"] / ours),
                     r["winner"], f"{r['compile_s'] * 1e3:.0f}"])
    worst = max(r["ours"] / r["lower_bound"] for r in data["cases"])
    slowest = max(r["compile_s"] for r in data["cases"])
    never_slower = all(r["ours"] <= min(r[k] for k in ("alpa_send_recv", "alpa_allgather", "broadcast_naive", "broadcast_size",
                                                       "broadcast_randomized-greedy")) + 1e-12 for r in data["cases"])
    nics = [[r["case"], f"{r['one_nic']:.3f}", f"{r['two_nics']:.3f}", x(r["one_nic"] / r["two_nics"]),
             f"{r['two_nics'] / r['two_nics_bound']:.4f}"] for r in data["two_nics"]]
    duplex = load("duplex.json")
    shared = [[r["case"], r["strategy"], r["tasks"], f"{r['bound_s'] * 1e3:.3f}", f"{r['duplex_predicted_s'] * 1e3:.3f}",
               f"{r['exclusive_hosts_predicted_s'] * 1e3:.3f}", f"{r['duplex_predicted_s'] / r['bound_s']:.3f}"] for r in duplex]
    return f"""\
## Paper cases, held against the bound

How close does a plan come to the physical lower bound on the paper's nine many-to-many cases (a 2 GiB int32
tensor, 1024x1024x512) and seven one-to-many cases (1 GiB, from one device to meshes of 1 to 8 devices), and how
does it compare with Alpa's approaches and with the paper's solvers? All times are predicted (see Metrics) on
the paper's cluster. Environment: {DEV_MACHINE}; under a minute.

{command(data["command"])}

Columns: **tasks**, the unit tasks (boxes with their holders and needers); five approaches' **predicted s**;
**ours / bound**; ours against Alpa's two approaches (**Alpa s/r / ours**, **Alpa a-g / ours**); the solver
`auto` kept; **compile ms**.

{table(rows, ["case", "layout (src -> dst)", "tasks", "Alpa send/recv", "Alpa all-gather", "bc naive", "bc size",
              "bc rand-greedy", "ours", "ours / bound", "Alpa s/r / ours", "Alpa a-g / ours", "winner", "compile ms"],
       "llrrrrrrrrrrlr")}

Worst ours / bound: **{worst:.4f}**; ours never slower than any other column on any case: **{never_slower}**;
slowest compile: **{slowest * 1e3:.0f} ms**.

The paper measured up to 10x over Alpa on case 4 on GPUs. The simulator prices bandwidth, latency and
queueing only (no NCCL communicator set-up, no kernel launches), and under it Alpa's device-order send/recv
on case 4 is 1.5x slower than ours, not 10x.

**Two NICs per host.** The same cases on hosts with two 10 Gbit/s NICs (same command). Every cross-host
message of a task is striped over all NICs of both hosts in proportion to their bandwidth, so the scheduler sees
a host's NICs as one pipe of their summed rate and the bound halves. Columns: ours predicted with one and two
NICs, the **gain**, and two NICs over their bound.

{table(nics, ["case", "1 NIC s", "2 NICs s", "gain", "2 NICs / bound"], "lrrrr")}

**Meshes that share hosts** (full duplex: a host that both sends and receives). Made by
`.venv/bin/python -m bench.bench_duplex`. A NIC sends and receives at once, so such a host's two directions
are two resources; the table sets the prediction under that model against one that lets a host do one
direction at a time (**exclusive hosts**). Times in ms.

{table(shared, ["problem", "strategy", "tasks", "bound ms", "duplex ms", "exclusive hosts ms", "duplex / bound"], "llrrrrr")}
"""


# ---- 2. weight sync ----------------------------------------------------------------------------------------------

def weight_sync() -> str:
    data = load("weight_sync.json")
    ours_key = "split_coalesce_posted_s"
    keys = [("split_hosts_posted_s", "ours without coalescing"), ("split_coalesce_sequential_s", "one plan per tensor"),
            ("rank0_gather_broadcast_s", "rank-0 gather + broadcast"), ("per_rank_broadcast_s", "per-rank broadcast"),
            ("alpa_send_recv_s", "Alpa send/recv"), ("alpa_allgather_s", "Alpa all-gather")]
    rows = []
    for r in data["rows"]:
        ours = r[ours_key]
        rows.append([r["problem"], r["tensors"], f"{r['gib']:.3f}", f"{r['lower_bound_s']:.4f}", f"{ours:.4f}",
                     x(ours / r["lower_bound_s"])] + [x(r[k] / ours) for k, _ in keys])
    scale = [[r["src_mesh"], f"{r['tasks']:,}", f"{r['compile_s']:.1f}", f"{r['verify_s']:.1f}", f"{r['peak_rss_mib']:.0f}",
              f"{r['predicted_s']:.4f}", f"{r['lower_bound_s']:.4f}", x(r["predicted_s"] / r["lower_bound_s"], 3)] for r in data["scaling"]]
    defaults = load("compile_defaults.json")
    singles = [[r["problem"], f"{r['default_host_s']:.4f}", f"{r['both_on_host_s']:.4f}", x(r["both_on_host_s"] / r["default_host_s"], 3),
                f"{r['default_device_s']:.4f}", f"{r['both_on_device_s']:.4f}"] for r in defaults["singles"]]
    transfers = [[r["problem"], r["default_operations"], r["both_off_operations"], x(r["default_posted_s"] / r["lower_bound_s"], 3),
                  x(r["both_off_posted_s"] / r["lower_bound_s"], 3) + ("" if r["both_off_posted_stated"] else " (not stated in the plan)"),
                  f"{r['default_compile_s']:.1f}", f"{r['both_off_compile_s']:.1f}"] for r in defaults["transfers"]]
    coalesce = load("coalesce.json")
    bundles = [["off" if not r["coalesce"] else f"--coalesce --bucket-mb {r['bucket_mb']:g}", r["operations"], r["busiest_messages"],
                x(r["ratio"], 3), x(r["posted_ratio"], 3), x(r["device-order_ratio"], 3), f"{r['compile_s']:.1f}"] for r in coalesce["rows"]]
    run, sync = load("weight_sync_run.json"), load("weight_sync_torch.json")
    labels = list(run["orders"]["posted"]["joint_ms"])
    measured = []
    for label in labels:
        posted, device = run["orders"]["posted"]["joint_ms"][label], run["orders"]["device"]["joint_ms"][label]
        measured.append([label, run["operations_or_shared_messages"][label], f"{posted:.2f}", f"{device:.2f}", f"{device / posted:.2f}",
                         f"{run['predicted']['posted']['joint_ms'][label]:.2f}", f"{run['predicted']['device-order']['joint_ms'][label]:.2f}"])
    measured.append(["one plan per tensor, one after another", f"{run['tensors']} plans", f"{run['orders']['posted']['one_after_another_ms']:.2f}",
                     f"{run['orders']['device']['one_after_another_ms']:.2f}",
                     f"{run['orders']['device']['one_after_another_ms'] / run['orders']['posted']['one_after_another_ms']:.2f}",
                     f"{run['predicted']['posted']['sequential_ms']:.2f}", f"{run['predicted']['device-order']['sequential_ms']:.2f}"])
    staging = load("staging.json")
    limited = [[r["plan"], f"{r['limit_mb']:g}", f"{r['plain_operations']} -> {r['operations']}", f"{r['peak_mib']:g}",
                f"{r['posted_peak_mib']:g}", f"{r['plain_predicted_s']:.4f} -> {r['predicted_s']:.4f}"] for r in staging["limited"]]
    return f"""\
## Weight sync

How fast does a whole model's weights move from the trainer's layout to the inference layout in one plan,
against one plan per tensor and against what RL frameworks and Alpa do? The examples are
`plans/weight_sync_*.problem.toml` (made by `planner/weight_sync.py`): FSDP on the source mesh to replicas of
tensor parallelism on the destination mesh; `weight_sync_llama3_8b` is a Llama-3-8B-like model (291 bfloat16
tensors, 4x8 -> 2x8). Predicted times on the paper's cluster. Environment: {DEV_MACHINE}.

{command(data["command"])}

**Ours** is one plan for every tensor as `xmesh-plan compile PROBLEM` makes it (`--split-hosts --coalesce
--cross-tensor`: one unit task per receiving host, small boxes between two hosts bundled, bundles of several
tensors in one message), timed **posted**, the order the MPI executor runs a multi-tensor plan in by default.
The other columns are each approach's time over ours: the same plan without coalescing; one plan per tensor,
run back to back; rank-0 gather then broadcast (verl / NeMo-RL style); every trainer rank broadcasting its own
block (per-rank broadcast); Alpa's two approaches, tensor after tensor in device order.

{table(rows, ["problem", "tensors", "GiB", "bound s", "ours s", "ours / bound"] + [f"{name} / ours" for _, name in keys],
       "lrrrrrrrrrrr")}

**Larger source meshes** (the Llama model from FSDP on N x 8 to the same 2x8; same command): compile and verify
wall clock, peak RSS and the plan's prediction (host order) over the bound.

{table(scale, ["source mesh", "unit tasks", "compile s", "verify s", "peak RSS MiB", "predicted s", "bound s", "/ bound"], "lrrrrrrr")}

**Compile defaults.** A multi-tensor problem compiles with `--split-hosts --coalesce` by default; a single
tensor keeps both off. Made by `{runnable(defaults["command"])}`. Single tensors, predicted s with the default and with
both switches on, host and device order:

{table(singles, ["problem", "default, host order", "both on, host order", "both on / default", "default, device order",
                 "both on, device order"], "lrrrrr")}

Multi-tensor problems, the default against both off (`--no-split-hosts --no-coalesce`: each box down a chain
through both destination hosts), posted, over the bound:

{table(transfers, ["problem", "operations (default)", "operations (both off)", "default / bound", "both off / bound",
                   "compile s (default)", "compile s (both off)"], "lrrrrrr")}

**Coalesced messages.** An all-to-all of 64 KiB boxes (32x8 `S0 R S1` -> `R S01 R`, 65,536 unit tasks), where
the per-message overhead is large next to a message's bytes. Made by `{runnable(coalesce["command"])}`. Columns: the
operations, the messages on the busiest NIC side, and the prediction over the bound in each order.

{table(bundles, ["compile", "operations", "busiest side's messages", "host order / bound", "posted / bound",
                 "device order / bound", "compile s"], "lrrrrrr")}

**Staging memory.** `--max-staging-mb N` cuts operations so that no device stages more than N MiB in device
order. Made by `{runnable(staging["command"])}`. Columns: the limit, operations plain -> limited, the device-order peak the
plan states, the peak posted order would need (the executor refuses posted order for such a plan), and the
predicted s (host order) plain -> limited.

{table(limited, ["plan", "limit MiB", "operations", "peak MiB (device order)", "posted would need MiB", "predicted s"], "lrrrrr")}

**On the executor.** The small example (21 tensors, 7.8 MiB) on {run["ranks"]} MPI ranks of the development
machine, every destination shard checked bit for bit; each figure is the median over {len(run["orders"]["posted"]["launches_ms"])}
launches per order of each launch's median of {run["iters"]} reshards. 8 ranks on 2 cores: compare ratios, not
times. The model columns are the simulator's times of the same plans on the reference cluster, not of this
machine. "Operations" counts a shared message's bundles once.

{command(run["command"])}

{table(measured, ["plan", "operations", "posted ms", "device ms", "device / posted", "model: posted ms",
                  "model: device order ms"], "lrrrrrr")}

**From a trainer's state dict, with `WeightSync`.** The demo's Llama-like model at the small example's size
({sync["tensors"]} float32 tensors, {sync["mib"]:.1f} MiB) under FSDP2 `fully_shard` on 4 gloo ranks, into two TP=2
replicas on 4 more (`xmesh_plan.weight_sync_demo`), one torchrun launch of {sync["ranks"]} ranks: `WeightSync.run()`
(received straight into the engine's tensors) against the same plan received into the executor's own buffers and
copied into the tensors after, and against each tensor's `full_tensor()` on the trainer ranks, broadcast from rank 0
to every rank and sliced into the engine's tensors, taking turns; medians of {sync["iters"]} syncs each, each checked
bit for bit once. Same machine: compare the ratios.

{command(sync["command"])}

{table([["WeightSync (one plan, received into the engine's tensors)", f"{sync['weight_sync_ms']:.2f}", x(1.0)]]
       + [[label, f"{sync[key]:.2f}", x(sync[key] / sync["weight_sync_ms"])] for key, label in COPIED_ROWS if key in sync]
       + [["full_tensor() + broadcast + slice", f"{sync['full_tensor_broadcast_slice_ms']:.2f}",
         x(sync["full_tensor_broadcast_slice_ms"] / sync["weight_sync_ms"])]]
       + [[label, f"{sync[key]:.2f}", x(sync[key] / sync["weight_sync_ms"])] for key, label in FUSED_ROWS if key in sync],
       ["per sync", "ms", "/ WeightSync"], "lrr")}

The fused WeightSync row and the redistribute row sync into an engine whose q, k, v and gate, up are fused
(qkv_proj, gate_up_proj): WeightSync with the fusion in its plan, into float32 tensors, and each tensor
`redistribute`d to its TP layout, then concatenated and cast into float16 tensors (`fused_ways` in the bench).
{converted_sync(sync["converted"])}
"""

COPIED_ROWS = (("executor_buffers_then_copy_ms", "the same plan into the executor's buffers, then copied"),)
FUSED_ROWS = (("weight_sync_fused_ms", "WeightSync, qkv / gate_up fused in the plan (float32, no cast)"),
              ("redistribute_cat_cast_ms", "redistribute per tensor + cat + cast to float16"))


def converted_sync(run: dict) -> str:
    """The fused and converting engine's rows of `bench_weight_sync_torch` (the same launch)."""
    return f"""
**Fused and converted destinations.** In the same launch, an engine that fuses qkv and gate_up and holds them in
FP8 e4m3 with 128x128 block scales, o and down in FP8 with per-tensor scales and the rest in float16/bfloat16
(`weight_sync_demo.converted_targets`; {run["tensors"]} tensors with the scale tensors, {run["mib"]:.1f} MiB at the trainer, on a
model whose FSDP shards lie on 128-row blocks): `WeightSync` with the fusion and the conversion in the plan (the
trainer ranks cast, converted bytes cross) against `full_tensor()` + broadcast + each inference rank slicing its
shares, concatenating the fused ones and casting with the scales it computes; both checked bit for bit against
torch's own cast once.

{table([["WeightSync (fused and converted in the plan)", f"{run['weight_sync_ms']:.2f}", x(1.0)],
        ["full_tensor() + broadcast + slice + cat + cast", f"{run['full_tensor_broadcast_slice_cat_cast_ms']:.2f}",
         x(run["full_tensor_broadcast_slice_cat_cast_ms"] / run["weight_sync_ms"])]], ["per sync", "ms", "/ WeightSync"], "lrr")}"""


# ---- 3. scale ----------------------------------------------------------------------------------------------------

def scale() -> str:
    data = load("scaling.json")
    rows = [[f"{r['src']} {r['src_spec']}", f"{r['dst']} {r['dst_spec']}", r["shape"], f"{r['tasks']:,}", f"{r['compile_s']:.2f}",
             f"{r['ratio']:.4f}", f"{r['task_mib']:.3f}", f"{100 * r['overhead_share']:.1f}%", r["winner"], f"{r['peak_rss_mib']:.0f}"]
            for r in data["points"]]
    limit = load("task_limit.json")
    base = limit["points"][0]
    tl = [[p["mesh"] + " -> " + p["mesh"], f"{p['tasks']:,}", f"{p['compile_s']:.2f}", f"{p['verify_s']:.2f}", f"{p['write_s']:.2f}",
           f"{p['peak_rss_mib']:.0f}", f"{p['plan_mib']:.1f}",
           f"{(p['peak_rss_mib'] - base['peak_rss_mib']) * 1024 / (p['tasks'] - base['tasks']):.1f}" if p is not base else "-",
           f"{p['total_s'] * 1e3 / p['tasks']:.3f}"] for p in limit["points"]]
    return f"""\
## Scale

How do compile time, memory and plan quality grow with the cluster and the number of unit tasks, and where
does the planner refuse a problem? Environment: {DEV_MACHINE}; compile times are noisy there.

{command(data["command"])}

One 10 Gbit/s NIC per host, 8 devices per host except the first row. Columns: **unit tasks**; **compile s**;
predicted over the bound (**/ bound**); **MiB per task**; **overhead share**, the per-message overhead over the
mean task time; the solver `auto` kept; **peak RSS MiB** (rows run in order of size, so a row's figure is its
own peak). Every row is timed by the simulator (host order).

{table(rows, ["source", "destination", "tensor", "unit tasks", "compile s", "/ bound", "MiB per task", "overhead share", "winner",
              "peak RSS MiB"], "lllrrrrrlr")}

Where tasks shrink to a few hundred KiB or less, the gap to the bound is mostly the per-message overhead
the bound leaves out, not the order: `xmesh-plan inspect` prints that share, and `--coalesce` closes it (see
"Coalesced messages" under Weight sync).

**Task limit.** What `xmesh-plan compile -o` costs per unit task, each size in a fresh process: (H,4) -> (H,4),
`S0 S1 R -> R S0 S1`, 8192x8192x64 float32, no limit. **KiB / task** is the peak's growth over the first row per
added task; **ms / task** the whole command's time per task.

{command(limit["command"])}

{table(tl, ["meshes", "unit tasks", "compile s", "verify s", "write s", "peak RSS MiB", "plan MiB", "KiB / task", "ms / task"],
       "lrrrrrrrr")}

Memory grows by about 8 KiB per unit task over a base of about 100 MiB. The default `--max-tasks` ({DEFAULT_MAX_TASKS:,},
`planner.unit_tasks.DEFAULT_MAX_TASKS`) keeps a compile under about {DEFAULT_MAX_TASKS * 8 / 2**20:.0f} GiB. A larger problem is refused from
its cut points, before anything is cut ({limit["refusal"]["seconds"] * 1e3:.1f} ms for 1000x4 -> 1000x4,
`S0 S1 R -> R S0 S1`, 4096x4096x512):

```
error: {limit["refusal"]["message"]}
```
"""


FRONTIER_TITLES = {"weight_sync_llama3_70b": "Llama-3-70B-like, 8x8 -> 2 x TP=8",
                   "weight_sync_deepseek_v3": "DeepSeek-V3-like MoE, 32x8 -> 4 x 4x8",
                   "weight_sync_kimi_k2": "Kimi-K2-like MoE into FP8, 32x8 -> 4 x 4x8"}
PERPLEXITY_KIMI_S = 1.3  # Perplexity's reported Kimi-K2 (1T) weight sync, 256 -> 128 GPUs, FP8 (issue 29's benchmark)


def _plan_mib(r: dict) -> str:
    """The plan file's MiB and its format (`compact`: a point measured writing `*.plan.npz`; older points wrote JSON)."""
    return f"{r['plan_bytes'] / 2**20:,.1f} ({'npz' if r.get('plan_format') == 'compact' else 'json'})"


def _frontier_row(r: dict) -> list:
    title = FRONTIER_TITLES.get(r["problem"], r["problem"]) + (f" ({r['layers']} layers)" if r.get("layers") else "") \
        + (f", --max-tasks {r['max_tasks']:,}" if r.get("max_tasks") else "")
    if not r["finished"]:
        return [title] + ["-"] * 10 + [f"did not finish in {r['timeout_s']:.0f} s ({r['last_phase']})"]
    executed = "-" if r["executor_over_bound"] is None else x(r["executor_over_bound"], 3)
    return [title, f"{r['gib']:.0f}", f"{r['tasks']:,}", f"{r['operations']:,}", f"{r['compile_s']:.1f}", f"{r['compile_cpu_s']:.1f}",
            f"{r['peak_rss_mib']:,.0f}", _plan_mib(r), f"{r['verify_s']:.1f}", x(r["predicted_over_bound"], 3),
            executed, r["timed_by"]]


def frontier_phases(points: list[dict]) -> str:
    """Each phase of the full-size points that recorded them: where the time and the memory go."""
    out = []
    for r in (r for r in points if r.get("finished") and r.get("phases") and not r.get("layers")):
        marks = r["phases"]
        rows = [[a[0], f"{b[1] - a[1]:.1f}", f"{b[2] - a[2]:.1f}", f"{b[3]:,.0f}"] for a, b in zip(marks, marks[1:])]
        out.append(f"""
Phases of the {FRONTIER_TITLES.get(r['problem'], r['problem'])} point (each from its start to the next's; peak RSS
of the process at its end):

{table(rows, ["phase", "wall s", "CPU s", "peak RSS MiB"], "lrrr")}
""")
    return "".join(out)


def staging_default_mib() -> str:
    return f"{load('staging_default.json')['limit_mib']:g}"


def _staging_row(title: str, flags: str, r: dict) -> list:
    bound = "-" if r["predicted_over_bound"] is None else x(r["predicted_over_bound"], 3)
    executed = "-" if r["executor_over_bound"] is None else x(r["executor_over_bound"], 3)
    device = "-" if r.get("device_over_bound") is None else x(r["device_over_bound"], 3)
    order = r["executor_order"] + (" within the limit" if r["limit_mib"] is not None and r["executor_order"] == "posted" else "")
    return [title, flags, f"{r['operations']:,}", f"{r['compile_cpu_s']:.1f}", "-" if r["limit_mib"] is None else f"{r['limit_mib']:g}",
            bound, order, executed, f"{r['staging_mib']:,.1f}", device]


def staging_window() -> str:
    """Each cut under a window of 1024 and 256 MiB: posted, posted within the window and device order (bench/bench_staging_window.py)."""
    if not (RESULTS / "staging_window.json").exists():
        return ""
    data = load("staging_window.json")
    rows = [[f"{FRONTIER_TITLES.get(r['problem'], r['problem'])} ({r['layers']} layers)", f"{r['window_mib']:g}", f"{r['operations']:,}",
             x(r["posted_over_bound"], 3), f"{r['posted_mib']:,.1f}", x(r["window_over_bound"], 3), f"{r['window_mib_peak']:,.1f}",
             x(r["device_over_bound"], 3), f"{r['device_mib']:,.1f}"] for r in data["points"]]
    return f"""
Posted within a window against posted and device order, each cut compiled with `--max-staging-mb W` and timed by the
simulator in the three orders (**posted**: every staged box at once; **window**: posted within W MiB per device, the
MPI engine's order for a plan that states a limit; **device**: one run at a time, the torch and NCCL engines'), over
the byte bound and with the busiest device's staging in MiB. Made by:

{command(data["command"])}

{table(rows, ["problem", "W MiB", "operations", "posted / bound", "posted MiB", "window / bound", "window MiB", "device / bound",
              "device MiB"], "lrrrrrrrr")}
"""


def staging_default() -> str:
    """Each cut and reference problem with default flags (posted) and with `--max-staging-mb 1024`
    (bench/bench_staging_default.py)."""
    data = load("staging_default.json")
    limit = f"--max-staging-mb {data['limit_mib']:g}"
    rows = []
    for r in data["cuts"]:
        title = f"{FRONTIER_TITLES.get(r['problem'], r['problem'])} ({r['layers']} layers)"
        rows += [_staging_row(title, "default flags", r["default"]), _staging_row(title, limit, r["limited"])]
    over = [r for r in data["cuts"] + data["references"] if r["default"]["posted_mib"] > data["limit_mib"]]
    multi = [r for r in data["references"] if r["default"]["executor_order"] == "posted"]
    posted = ", ".join(f"{r['problem']} {r['default']['staging_mib']:.1f} MiB" for r in multi)
    return f"""
### Staging default

A plan given no `--max-staging-mb` states no staging limit and runs posted, the executor's default order for a
multi-tensor plan, every staged box at once. Where that stages more than {data['limit_mib']:g} MiB on a device
(`compile_defaults.POSTED_STAGING_WARN_BYTES`), `xmesh-plan compile` prints one line naming the busiest device, its
GiB, and `--max-staging-mb N` or a smaller `--bucket-mb`. A plan that states a limit runs posted within it on MPI
(`executor/window.py`): each device's staged operations take ranges of a ring of N MiB in plan order, and an
operation goes once the earlier ones it overlaps there have finished. Each problem below compiled with default flags
and with `{limit}` in one process. Made by:

{command(data["command"])}

Columns: **operations**; **compile CPU s** (with the simulations in host order and in the executor's order); the
staging **limit MiB** the plan states; its host-order prediction over the byte bound
(**/ bound**); the **executor order** and its time there over the bound; the busiest device's **staging MiB** in
that order; and with a limit, the time in **device order** over the bound (how the torch and NCCL engines run it:
a device takes part in one run of operations with the same peers at a time, which costs time on these plans).

{table(rows, ["problem", "flags", "operations", "compile CPU s", "limit MiB", "/ bound", "executor order", "executor / bound",
              "staging MiB", "device order / bound"], "llrrrrlrrr")}
{staging_window()}
Compile prints its note (posted staging over {data['limit_mib']:g} MiB on a device) for
{", ".join(r["problem"] + (f" ({r['layers']} layers)" if "layers" in r else "") for r in over) if over else "none of these"};
on the reference plans (`make plans`) single-tensor plans run in device order, and the multi-tensor ones stage
at most this posted: {posted}. A plan that states staging is verified from its records, not from a compact file's
columns (`verify_columns` does not prove stated staging; on the 16-layer Llama-3-70B-like cut 1.7 CPU s against 0.1).
"""


def frontier() -> str:
    runs = [load(name) for name in ("frontier.json", "frontier-shrunk.json") if (RESULTS / name).exists()]
    rows = [_frontier_row(r) for data in runs for r in data["points"]]
    made = dict.fromkeys(r.get("command", data["command"]) for data in runs for r in data["points"])  # in row order, once each
    commands = "\n\n".join(command(text) for text in made)
    return f"""\
## Frontier scale

How long do the weight syncs the frontier runs take to plan, in what memory, and how close to the bound? A
Llama-3-70B-like dense model (80 layers) from an 8x8 FSDP mesh to 2 replicas of TP=8, and a DeepSeek-V3-like MoE
(671B; 61 layers of MLA attention, 58 of them with 256 experts stacked as [256, 2048, 7168] tensors) from 32x8
FSDP + EP to 4 inference instances of 4 hosts of 8 GPUs (experts split over an instance's 32 GPUs, attention TP=8
inside a host); bfloat16, 8 x 400 Gbit/s NICs per host (`plans/weight_sync_llama3_70b.problem.toml`,
`plans/weight_sync_deepseek_v3.problem.toml`); and a Kimi-K2-like MoE (1T; 61 layers, 384 experts, the first layer
dense) on the same meshes with FP8 destinations (`plans/weight_sync_kimi_k2.problem.toml`, below). Each row is one fresh process running what `xmesh-plan compile -o`
and `verify` do, with default flags. Environment: {DEV_MACHINE}; wall-clock seconds there depend on the other
jobs, CPU seconds much less.

{commands}

Columns: **GiB** moved once; **unit tasks** and **operations** of the plan; **compile s** wall clock and
**compile CPU s**; **peak RSS MiB** of the process when the compile returned; **plan MiB**, the file in the format
the point wrote (npz: compact, written from the compile's rows and verified from its columns, as `compile -o
NAME.plan.npz` does; json: a point that wrote a JSON plan);
**verify s**; the plan's predicted time over the byte bound (**/ bound**) and its time in the executor's order
(**executor / bound**, where the plan states it), and what timed the plan (`solver.details.timed_by`): the
simulator in host order, or the schedule's own timetable for a plan of more than `compile.MAX_SIMULATED_MESSAGES`
messages (counted from its operations before any flow is made; the full DeepSeek-V3-like plan has 390,400, a shared message's intra-host messages one per pair of devices) or one whose simulation would take more than `compile.MAX_SIMULATION_WORK` units of work. A multi-tensor plan over `compile.MAX_SIMULATED_MESSAGES` is still simulated once, in the executor's default order alone (up to `executor_order.MAX_EXECUTOR_MESSAGES` messages and `EXECUTOR_WORK` units of work), so the time compile states for the executor is the simulator's: the full DeepSeek-V3-like plan
(`xmesh-plan compile plans/weight_sync_deepseek_v3.problem.toml -o ds.plan.npz`) runs posted, the executor's
default order for it, in 0.9193 s, 1.018x its 0.9030 s bound (the schedule's timetable 1.031x); `check --simulate` at 788d848 took
204 CPU s and 5.6 GiB peak RSS (both orders, verify, and reading the plan as records, included) on this machine. The full Kimi-K2-like plan (the same way, 315,632 messages)
runs posted in 0.6851 s, 1.023x its 0.6699 s bound (the schedule's timetable 1.084x); `check --simulate` 252 CPU s and 5.9 GiB. A row with `--max-tasks` ran with that limit. `--max-tasks` counts
what a compile holds (each kind of tensor's boxes, then the tasks it schedules; docs/format.md), so the full
DeepSeek-V3-like problem (613,248 tasks with the 32 MiB bucket; 667,520 with 4 MiB) passes the default. Its compile keeps the plan as rows, not records
(`planner/plan_rows.py`), writes the compact file from them and verifies that file; a point that ran out of time
names the phase it was in, and a finished full-size point lists its phases below the table. Every row uses the 32 MiB default bucket below. On these hosts every message
is striped over the 8 NICs and each NIC pays its per-message overhead (`inspect` says so), so the default bundle
bucket is 32 MiB, what the NICs move in 80 us (`coalesce.default_bucket_bytes`; 4 MiB on one 400 Gbit/s NIC):
boxes up to 4 MiB travel in bundles, fewer and larger messages. Bundles are staged, and posted order stages all
of them at once: every row states no staging limit and runs posted, and compile names `--max-staging-mb` where a
device stages more than {staging_default_mib()} MiB so (the staging default, below).

{table(rows, ["problem", "GiB", "unit tasks", "operations", "compile s", "compile CPU s", "peak RSS MiB", "plan MiB",
              "verify s", "/ bound", "executor / bound", "timed by"], "lrrrrrrrrrrl")}
{staging_default()}{frontier_phases([r for data in runs for r in data["points"]])}{frontier_baselines([r for data in runs for r in data["points"]])}{moe_mpi()}"""


def moe_mpi() -> str:
    """The DeepSeek-V3-like plan on 48 MPI ranks (bench/bench_moe_mpi.py)."""
    if not (RESULTS / "moe_mpi.json").exists():
        return ""
    r = load("moe_mpi.json")
    verdict = "bit-exact" if r["check_ok"] else f"FAILED (exit {r['returncode']})"
    return f"""
### The MoE plan on {r['ranks']} MPI ranks

The executor runs the DeepSeek-V3-like structure on {r['ranks']} MPI ranks, the largest world launched here (about
115 MiB per rank; the machine's memory is shared) (`plans/weight_sync_deepseek_v3_48.problem.toml`): its real tensor shapes for 3 layers (the dense first one, 2 MoE
ones with 256 stacked experts; {r['tensors']} tensors, {r['gib']:.1f} GiB), sources FSDP + EP over 2 hosts of 8
GPUs, destinations 2 inference instances of 2 hosts of 8 GPUs (experts split over an instance's 16 GPUs, attention
TP=8 inside a host). The plan is compiled with default flags ({r['compile_s']:.0f} s wall; {r['operations']:,}
operations: {', '.join(r['kinds'])}); `executor.run` shrinks every tensor to at most {r['max_mb']:g} MiB, dims in
proportion, so every operation stays with a smaller box, and checks every destination shard: **{verdict}**. The
launch took {r['launch_wall_s']:.0f} s wall on {DEV_MACHINE} (all {r['ranks']} ranks on its cores, so times per
iteration say nothing about a cluster). Rank 0's report:

{command(r['command'])}

```
{r['report']}
```
"""


def _ours(point: dict, ours: list[dict]) -> tuple[float, str] | None:
    """Our plan's time on a baseline point's problem and cut (executor order where the plan states it), and how it was timed."""
    row = next((r for r in ours if (r["problem"], r.get("layers")) == (point["problem"], point["layers"]) and r["finished"]), None)
    if row is None:
        return None
    if row["executor_over_bound"] is not None:
        return row["executor_over_bound"] * row["bound_s"], f"simulated, {row['executor_order']}"
    how = row["timed_by"].split(" (")[0]
    return row["predicted_over_bound"] * row["bound_s"], "schedule's timetable" if how == "schedule" else how


def _seconds(value: float, bound: float) -> str:
    return f"{value:.3f} ({x(value / bound)})"


def _baseline_row(p: dict, ours: list[dict]) -> list:
    mine = _ours(p, ours)
    cells = [FRONTIER_TITLES.get(p["problem"], p["problem"]) + (f" ({p['layers']} layers)" if p["layers"] else ""),
             f"{p['wire_gib']:.0f}", f"{p['bound_s']:.3f}", "-" if mine is None else f"{_seconds(mine[0], p['bound_s'])}, {mine[1]}"]
    for name in ("checkpoint-engine-broadcast", "rank0-gather-broadcast"):
        b = p["baselines"][name]
        simulated = f"; simulated {_seconds(b['simulated_s'], p['bound_s'])}" if "simulated_s" in b else ""
        cells.append(f">= {_seconds(b['estimate_s'], p['bound_s'])} ({b['busiest']}){simulated}")
    cells.append(_seconds(p["per_tensor"]["seconds"], p["bound_s"]) + f", {len(p['per_tensor']['kinds'])} kinds" if "per_tensor" in p else "-")
    return cells


def _kimi_ours(ours: list[dict]) -> str:
    """What our plan of the Kimi-K2-like problem is known to take: the full problem's row, else a cut's, not scaled."""
    rows = [r for r in ours if r["problem"] == "weight_sync_kimi_k2" and r["finished"]]
    full = next((r for r in rows if not r.get("layers")), None)
    if full is not None:
        mine = _ours({"problem": full["problem"], "layers": None}, ours)
        return f"Our plan of it: {mine[0]:.3f} s ({x(mine[0] / full['bound_s'])} its bound; {mine[1]})."
    if not rows:
        return "Our plan of it is not compiled here."
    cut = max(rows, key=lambda r: r["layers"])
    llama = {r.get("layers") or 80: x(r["predicted_over_bound"]) for r in ours if r["problem"] == "weight_sync_llama3_70b" and r["finished"]}
    drift = ", ".join(f"{ratio} at {layers} layers" for layers, ratio in sorted(llama.items()))
    return (f"The full problem is not compiled here (the DeepSeek-V3-like one takes minutes of CPU and GiBs, above). A {cut['layers']}-layer "
            f"cut compiles ({cut['compile_s']:.0f} s wall, {cut['peak_rss_mib']:,.0f} MiB): {cut['predicted_over_bound'] * cut['bound_s']:.4f} s, "
            f"{x(cut['predicted_over_bound'])} its own bound, timed by the {cut['timed_by']}. That ratio is not carried to 61 "
            f"layers: it is not constant in the number of layers (the Llama-3-70B-like plan: {drift}, above), so no "
            f"full-size prediction is given.\n")


def frontier_baselines(ours: list[dict]) -> str:
    """The baselines beside ours on the frontier problems (bench/bench_frontier_baselines.py)."""
    if not (RESULTS / "frontier-baselines.json").exists():
        return ""
    points = load("frontier-baselines.json")["points"]
    made = "\n\n".join(command(text) for text in dict.fromkeys(p["command"] for p in points))
    kimi = next((p for p in points if p["problem"] == "weight_sync_kimi_k2" and not p["layers"]), None)
    perplexity = "" if kimi is None else f"""
The Kimi-K2-like problem (1T parameters, 61 layers, 384 experts; `plans/weight_sync_kimi_k2.problem.toml`) moves
{kimi['wire_gib']:.0f} GiB once its destinations are FP8 (routed experts with 128x128 block scales, the other layer
projections with per-tensor scales; embeddings, LM head, norms and router stay bfloat16, {kimi['gib']:.0f} GiB at the
source). Its byte bound on this network is {kimi['bound_s']:.3f} s ({kimi['bound_reason']}); Perplexity reports
{PERPLEXITY_KIMI_S} s for the same move (256 -> 128 GPUs, FP8; their network may differ), {PERPLEXITY_KIMI_S / kimi['bound_s']:.2f}x this bound.
{_kimi_ours(ours)}"""
    rows = [_baseline_row(p, ours) for p in points]
    return f"""
### Beside ours: the RL frameworks' weight syncs

The same problems in the same network model (8 x 400 Gbit/s NICs per host, 2400 Gbit/s between the GPUs of a
host): checkpoint-engine's broadcast (every source rank broadcasts the blocks it holds to every inference rank,
which keeps its part), rank-0 gather then broadcast (verl / NeMo-RL style), and one plan per tensor back to back
(our planner on each tensor alone, one after another). Simulating the two broadcasts at full size means millions of
chunk messages, so each is given as its least time in the model (`planner/baseline_bounds.py`): the busiest NIC
side, GPU port or GPU (a GPU takes part in one operation at a time, in device order) from its bytes, with no
latency, per-message overhead or pipeline fill; the simulator gives the same operations at least that (`>=`), and
on a cut (`--simulate`) the table shows both. One plan per tensor: tensors of one kind (shape, dtypes, layouts) have
the same plan, so one plan per kind is compiled with default flags, simulated in device order and multiplied by the
kind's count. **ours**: the plan's time from the frontier table above (same problem and cut), in the executor's
order where the plan states it, else as timed there; '-' where no plan compiled here. Seconds, with each over the
byte bound; the busiest link or device of each estimate in parentheses.
{perplexity}
{made}

{table(rows, ["problem", "GiB crossing", "bound s", "ours s", "checkpoint-engine broadcast s", "rank-0 gather + broadcast s",
              "one plan per tensor s"], "lrrllll")}
"""


def verify_scale() -> str:
    data = load("verify_scale.json")
    rows = [[label, r["commit"], f"{r['plan_bytes'] / 2**20:,.0f}", f"{r['cpu_s']:.1f}", f"{r['wall_s']:.1f}", f"{r['peak_rss_mib']:,.0f}"]
            for label, r in sorted(data["points"].items(), key=lambda item: item[1]["cpu_s"], reverse=True)]
    return f"""\
### Verify at scale

How long does `xmesh-plan verify` take on a compact plan of 10^6 operations? `bench/bench_verify_scale.py` builds a
synthetic plan of 10^6 broadcasts (one row of a float32 [10^6, 64] tensor each, 8 -> 4x2 devices, with their 10^6
unit tasks), writes it compact, and times `xmesh-plan verify` on it in a fresh process: CPU seconds (user + system),
wall seconds and peak RSS of that process. Each row is one commit of the code on the same machine ({DEV_MACHINE};
the wall clock there depends on the other jobs, CPU seconds much less); the plan file is the one that commit writes, and a row is remade by running the command below in a checkout of its commit.
`records` reads every operation as a record and verifies those; `columns` proves the plan from the file's
columns (`planner/verify_columns.py`), reading as records only what the arrays do not prove (none here).

{command(data["command"])}

{table(rows, ["code", "commit", "plan MiB", "CPU s", "wall s", "peak RSS MiB"], "llrrrr")}
"""


# ---- 4. executor overhead ----------------------------------------------------------------------------------------

def made_by(command: str | None) -> str:
    """The command that wrote a rank-load plan file, as recorded (`bench_rank_load --made-by`), or that it was not."""
    return f"`{command}`" if command else "a command not recorded"


def rank_load_over_target(loads: list[dict]) -> str:
    """The rank-load rows that miss the target (1 CPU s, 256 MiB peak RSS), named, or that none does."""
    over = [f"`{p['plan']}` device {r['device']} ({'whole plan' if r['whole'] else 'its part'}: {r['cpu_s']:.2f} CPU s, "
            f"{r['peak_rss_mib']:,.0f} MiB)" for p in loads for r in p["rows"] if r["cpu_s"] >= 1 or r["peak_rss_mib"] >= 256]
    if not over:
        return "Every row is within the target (under 1 CPU s and 256 MiB peak RSS)."
    return "Rows that miss the target (1 CPU s or more, or 256 MiB peak RSS or more): " + "; ".join(over) + "."


def executor_overhead() -> str:
    data = load("executor.json")
    rev = data["compared_with"]
    rows = []
    for r in data["cpu_overhead"]:
        cur, before, base = r["current"], r["before"], r["baseline_s"]
        rows.append([r["kind"], r["ranks"], r["tasks"], f"{cur['executor_s'] * 1e3:.3f}", f"{base * 1e3:.3f}" if base else "-",
                     f"{(cur['executor_s'] - base) * 1e6 / r['tasks']:.1f}" if base else "-", f"{cur['executor_s'] * 1e6 / r['tasks']:.1f}",
                     cur["alloc_peak_bytes_max_rank"], cur["alloc_net_bytes_max_rank"], cur["python_calls_per_run_max_rank"],
                     before["python_calls_per_run_max_rank"], before["alloc_peak_bytes_max_rank"],
                     f"{before['executor_s'] * 1e3:.3f}", f"{cur['executor_s'] / before['executor_s']:.2f}"])
    torch_rows = [[r["kind"], r["ranks"], r["tasks"], f"{r['engine_s'] * 1e3:.3f}", f"{r['bare_s'] * 1e3:.3f}" if r.get("bare_s") else "-",
                   f"{r['time_ratio']:.2f}" if r.get("time_ratio") else "-", r["engine_peak_bytes"],
                   r.get("bare_peak_bytes") or "-", f"{r['alloc_ratio']:.2f}" if r.get("alloc_ratio") else "-",
                   r["engine_net_bytes"]] for r in load("torch_engine.json")]
    lowering = load("lowering.json")
    low = [[r["plan"], r["operations"], r["device"], r["steps"], f"{r['lower_s']:.3f}", f"{r['before_s']:.3f}", f"{r['lower_s'] / r['before_s']:.2f}"]
           for r in lowering["rows"]]
    loads = load("rank_load.json")["plans"]
    rank_rows = [[p["plan"], p.get("commit") or "not recorded", r["device"], "whole plan" if r["whole"] else "its part (index)",
                  f"{r['operations']:,}", f"{r['steps']:,}", r["order"], f"{r['seconds']:.2f}", f"{r['cpu_s']:.2f}",
                  f"{r['peak_rss_mib']:,.0f}", f"{r['peak_rss_mib'] - r['imports_rss_mib']:,.0f}"] for p in loads for r in p["rows"]]
    rank_plans = "\n".join(f"- `{p['plan']}`: {p['operations']:,} operations, {p['tensors']} tensors, a {p['file_bytes'] / 2**20:.1f} MiB "
                            f"compact file written by {made_by(p.get('made_by'))}; measured by `{p['command']}`." for p in loads)
    rank_over = rank_load_over_target(loads)
    redistribute = [[r["move"], r["ranks"], "x".join(map(str, r["shape"])) + f" ({r['mib']:.1f} MiB)", f"{r['redistribute_s'] * 1e3:.2f}",
                     f"{r['baseline_s'] * 1e3:.2f}", f"{r['baseline_over_ours']:.2f}"] for r in load("redistribute.json")]
    return f"""\
## Executor overhead

What does the executor add per iteration on top of the messages themselves, and does a change to it cost
time or allocation? Environment: {DEV_MACHINE}. All ranks share two cores, so absolute times say little about
a cluster; the ratios within one run are what count.

```
.venv/bin/python -m bench.bench_executor --iters 40 --compare {rev}
```

Plans of T unit tasks of one 64 B box each: `send`, device 0 -> device 1, rows (sent in place);
`send_strided`, columns (packed and unpacked through staging); `broadcast`, rows down the chain 1 -> 2 -> 3.
Columns: **run() ms**, one `ReshardingExecutor.run()` (median of 40); **bare mpi4py ms**, plain
`Isend`/`Irecv` of the same rows into the same buffers finished by `Waitall` (the data movement alone);
**overhead us / task** = (run() - bare) / T; **run() us / task**; **peak B**, the largest rise of traced Python
memory during one call (tracemalloc, worst rank); **net B**, what stays allocated after all calls; **calls**, the
Python function calls one run() makes (a profile hook counting them; the fewest over the 40 calls, worst rank): a
count of the work a call does, which load barely changes (polls while waiting for a peer mostly drop out with the
fewest; at 256 and more tasks a few remain, which is why the revisions differ there by up to 2% either way); and the
same measures with the executor of git revision `{rev}` (`--compare`: its whole package, run from a copy of that
revision by the same script, alternating with the current one plan by plan), with **now / {rev}**, the time
ratio. "No worse than {rev}" reads off the calls and peak columns, which do not depend on the timing: equal calls
are the same work per run(). The time ratios scatter on this shared machine (4 ranks on 2 cores for `broadcast`), and
a peak differs by 24 B (one float object) now and then in either revision: with the same script and 64 tasks,
199 of 200 calls peak at 96 B in both revisions and the odd one at 120 or 128 B, so the worst of 40 calls
catches it or not by chance.

{table(rows, ["plan", "ranks", "unit tasks", "run() ms", "bare mpi4py ms", "overhead us / task", "run() us / task", "peak B", "net B",
              "calls", f"{rev} calls", f"{rev} peak B", f"{rev} run() ms", f"now / {rev}"], "lrrrrrrrrrrrrr")}

Every message is a persistent request made in `prepare()` and restarted each call, polled one at a time;
every copy, pack and unpack is a pair of views made in `prepare()`, so a call allocates a fixed handful of
objects whatever the task count.

**The torch engine (gloo)** against bare `dist.isend`/`dist.irecv` of the same rows, in the same processes.
Made by `.venv/bin/python -m bench.bench_torch_engine --tasks 16,64,256 --iters 20`; median of 20, slowest rank.
**time ratio** and **alloc ratio** are engine over bare.

{table(torch_rows, ["plan", "ranks", "unit tasks", "run() ms", "bare ms", "time ratio", "peak B", "bare peak B", "alloc ratio",
                    "net B"], "lrrrrrrrrr")}

**Lowering in `prepare()`** on plans that gather a tensor from many hosts onto one (`S01 R R` -> `R R R`,
`local_allgather`): the busiest destination device's steps, the time of `lower()` for it, and the same with
the lowering of git revision `{lowering["compared_with"]}` (best of 5). Made by
`.venv/bin/python -m bench.bench_lowering --compare {lowering["compared_with"]} --repeat 5`.

{table(low, ["plan", "operations", "busiest device", "its steps", "lower() s", f"{lowering['compared_with']} s", "ratio"], "lrrrrrr")}

**One rank's load and lowering** of a large plan, before any byte moves (target: under 1 s and 256 MiB). The plans:

{rank_plans}

Each row is one fresh process doing what `TransferExecutor.from_file(path, comm).prepare()` does for one device on
the MPI engine: read the file's header, read the device's operations through the file's index, check them, lower
them and run the passes of the executor's default order (`passes.rank_program`); a `whole plan` row does the same
through the whole plan (`read_plan_file`, then the plan object, checked whole). Columns: **plan**; **commit**, the
revision the row was measured at; **device** (the source and the destination device with the most operations);
what it **read**; its **operations** and lowered **steps**; the **order** its program runs in; **s** wall clock and
**CPU s** from the start of the load to the program (wall clock depends on the other jobs on this machine, CPU
seconds much less); **peak RSS MiB** of the process, and the part **above imports** (what it held once Python, numpy
and the package were imported).

{table(rank_rows, ["plan", "commit", "device", "read", "operations", "steps", "order", "s", "CPU s", "peak RSS MiB", "above imports"],
        "llrlrrlrrrr")}

{rank_over}

**`redistribute` against `full_tensor()` + broadcast + slice**, what a DTensor user writes to cross meshes
without this package: every source rank gathers the tensor, the source mesh's first rank broadcasts it, each
destination rank slices its shard. 4 gloo processes; median of the slowest rank; both results checked equal
first. Made by `.venv/bin/python -m bench.bench_redistribute`. `handoff`: [0, 1] Shard(0) -> [2, 3] Shard(1);
`grid_to_replicas`: 2x2 (Shard(0), Shard(1)) -> [2, 3] Replicate(); `same_ranks`: [0..3] Shard(0) -> Shard(1).

{table(redistribute, ["move", "ranks", "tensor", "redistribute ms", "baseline ms", "baseline / ours"], "lrlrrr")}

**GPU.** No GPU is part of this environment: the NCCL engine's pack/unpack throughput and broadcast times are
not in any results file. `bench/bench_executor.py` measures them (`gpu_bench`) where CuPy finds a device.
"""


# ---- 5. emulated cluster -----------------------------------------------------------------------------------------

NETLAB = [  # (file, engine, order, rate label)
    ("netlab-mpi-device-500-32mb.json", "MPI", "device"), ("netlab-mpi-device-500-32mb-cases7-16.json", "MPI", "device"),
    ("netlab-mpi-device-200-16mb.json", "MPI", "device"), ("netlab-torch-device-500-32mb.json", "torch", "device"),
    ("netlab-torch-device-200-16mb.json", "torch", "device"), ("netlab-mpi-posted-500-32mb.json", "MPI", "posted"),
    ("netlab-mpi-posted-200-16mb.json", "MPI", "posted"),
]
MODEL = {"posted": "posted", "device": "device-order"}


def _netlab_runs(name: str):
    data = load(name)
    for run in data["runs"]:
        yield data["meta"], run


def _model(meta: dict, run: dict, row: dict) -> float:
    """The saved prediction a row is held against: with the CPU model where the run saved one, in its executor order."""
    predicted = row.get("predicted_cpu_s") or row["predicted_s"]
    return predicted[MODEL[run.get("order", meta["order"])]]


def emulated() -> str:
    ours_rows, fits = [], {}
    for name, engine, order in NETLAB:
        for meta, run in _netlab_runs(name):
            by = {r["approach"]: r for r in run["rows"] if r["measured_s"]}
            ours = by.get("ours")
            if not ours:
                continue
            distinct = [r for r in by.values() if not r.get("same_as")]
            good = sum(abs(r["measured_s"] / _model(meta, run, r) - 1) <= 0.10 for r in distinct)
            key = (engine, order, run["rate_mbit"])
            fits[key] = (fits.get(key, (0, 0))[0] + good, fits.get(key, (0, 0))[1] + len(distinct))
            plan = sum(h["predicted_sent"] + h["predicted_received"] for h in run["links"])
            link = sum(h["sent"] + h["received"] for h in run["links"])
            others = [f"{by[a]['measured_s'] / ours['measured_s']:.2f}" if a in by else "-" for a in ("naive", "alpa-send-recv", "alpa-allgather")]
            ours_rows.append([run["case"], engine, order, f"{run['rate_mbit']:g}", f"{ours['measured_s'] * 1e3:.0f}",
                              f"{ours['measured_s'] / ours['predicted_s']['lower-bound']:.3f}", f"{ours['measured_s'] / _model(meta, run, ours):.2f}"]
                             + others + [f"{good} of {len(distinct)}", f"{link / plan:.4f}", "yes" if run["checked"] else "NO"])
    fit_rows = [[engine, order, f"{rate:g}", f"{good} of {total}"] for (engine, order, rate), (good, total) in fits.items()]
    receipts = []
    for rate, mb in ((200, 16), (500, 32)):
        with_r = {r["case"]: r for _, r in _netlab_runs(f"netlab-torch-device-{rate}-{mb}mb.json")}
        without = {r["case"]: r for _, r in _netlab_runs(f"netlab-torch-device-{rate}-{mb}mb-no-receipts.json")}
        ratios = [next(x for x in with_r[c]["rows"] if x["approach"] == "ours")["measured_s"]
                  / next(x for x in without[c]["rows"] if x["approach"] == "ours")["measured_s"] for c in with_r if c in without]
        receipts.append([f"{rate}", f"{min(ratios):.3f}-{max(ratios):.3f}", f"{statistics.median(ratios):.3f}", len(ratios)])
    sync = []
    for name in ("netlab-weight-sync-device-500.json", "netlab-weight-sync-posted.json", "netlab-alltoall-device-500.json",
                 "netlab-alltoall-posted-500.json"):
        for meta, run in _netlab_runs(name):
            for r in run["rows"]:
                if r["measured_s"]:
                    sync.append([run["case"], r["approach"], meta["order"], f"{run['rate_mbit']:g}", f"{r['measured_s'] * 1e3:.1f}",
                                 f"{r['measured_s'] / _model(meta, run, r):.2f}", f"{r['measured_s'] / r['predicted_s']['lower-bound']:.3f}"])
    first = re.sub(r" --out \S+", "", runnable(load(NETLAB[0][0])["meta"]["command"])).replace(" --no-markdown", "")
    return f"""\
## Emulated cluster, measured against the model

Does the network model predict what real processes on real (rate-limited) links do, and does ours stay near
the byte bound there? `bench/netlab` runs every paper case through the executor on an emulated cluster: one
network namespace per plan host with one shaped link (htb at 200 or 500 Mbit/s, MTU 9000), the ranks of a
host inside its namespace, every destination shard checked, the links' byte counters read. What the model
assumes, what the links do and where the model is off: [docs/netlab.md](docs/netlab.md). Environment: the
development machine as root, nothing else running; every rank shares its 2 cores, which is why the rates are
low and why the model includes that CPU (`Cluster.cpu`). Plans are made with `--plan-cpu` on the tensor that
runs (32 MiB at 500 Mbit/s, 16 MiB at 200), 5 timed reshards after 1 warm-up.

```
{first}
sudo make bench-net      # every case in both executor orders; NETLAB_ARGS narrows it
```

The files: `bench/results/netlab-{{mpi,torch}}-{{device,posted}}-{{500-32mb,200-16mb}}.json` (the MPI 500 Mbit/s
device-order run is split in two files, cases 1-6 and 7-16). Columns: **ours ms**, measured; **ours / bound**;
**ours / model**, measured over the prediction saved with the run (the executor's order, with the CPU model);
the others' measured time over ours; **within 10%**, the launch's distinct plans within 10% of their saved
prediction; **link / plan bytes**, the bytes the links carried over the bytes the plans send across NICs (TCP/IP
headers and control traffic); **bit-exact**, every destination shard checked.

{table(ours_rows, ["case", "engine", "order", "Mbit/s", "ours ms", "ours / bound", "ours / model", "naive / ours", "Alpa s/r / ours",
                   "Alpa a-g / ours", "within 10%", "link / plan bytes", "bit-exact"], "lllrrrrrrrrrl")}

Distinct plans within 10% of the prediction saved with each run:

{table(fit_rows, ["engine", "order", "Mbit/s", "within 10%"], "lllr")}

The prediction saved with a run is the model the run was made with (the testbed's link sharing and CPU,
`bench/netlab/predict.py`). `.venv/bin/python -m bench.netlab.repredict bench/results/<file>`
rebuilds every plan of a file and prices it with this checkout's model, with and without the CPU; it simulates
every plan, so it is not part of this table (docs/netlab.md gives its figures).

**The torch engine's receipts.** In device order the torch engine on gloo has the receiver of an operation's
large messages send a 1-byte receipt back, so a rank starts its next operation only once its sends have
arrived (docs/executor.md, "Order"). The same launches with `--no-receipts` (files `...-no-receipts.json`):
ours measured with receipts over without, per case:

{table(receipts, ["Mbit/s", "range", "median", "cases"], "rrrr")}

**Weight sync and bundles on the emulated cluster** (`--cases weight_sync_small` and `alltoall_2x4`, 16 MiB,
3 timed reshards, MPI, plans without the CPU model; files `netlab-weight-sync-*.json`, `netlab-alltoall-*.json`).
**/ model** is measured over the saved prediction in the run's order.

{table(sync, ["case", "approach", "order", "Mbit/s", "measured ms", "/ model", "/ bound"], "lllrrrr")}
"""


# ---- 6. pipelines ------------------------------------------------------------------------------------------------

PIPELINE_COLUMNS = ("1f1b (no overlap)", "1f1b", "eager-1f1b", "eager-1f1b-wd", "signal")


def pipelines() -> str:
    data = load("pipeline.json")
    rows = []
    for case in data["cases"]:
        t = {label: m["iteration_s"] for label, m in case["schedules"].items()}
        rows.append([case["case"], case["stages"]] + [f"{t[label]:.2f}" for label in PIPELINE_COLUMNS]
                    + [f"{100 * t['signal'] / t['eager-1f1b']:.1f}%", f"{100 * t['signal'] / t['eager-1f1b-wd']:.1f}%"])
    return f"""\
## Pipelines

Which pipeline schedule hides cross-mesh resharding best, and how close does it come to a pipeline whose
transfers are free? Every transfer's plan is compiled (broadcast strategy, `auto` solver), each schedule is
built, validated and replayed by the simulator (`planner/pipeline/simulate.py`): iteration times are
**predicted**, not measured on GPUs. Each stage is one host of 4 V100s (logical mesh 2x2 or 4x1) with one
10 Gbit/s NIC, the paper's p3.8xlarge; compute is 2·P·tokens FLOPs per part (forward, input gradient, weight
gradient) at 40 TFLOP/s per GPU in FP16 and 10 in FP32; 16 micro-batches. GPT sends one activation to the next
stage; the U-Transformer-like model also sends its U-Net levels' skips to the mirrored stage. Pipeline files:
`bench/pipelines/`; the assumptions are in the script's docstring. Environment: {DEV_MACHINE}.

{command(data["command"])}

Columns: iteration time in seconds per schedule (lower is better): **1f1b (no overlap)**, 1F1B with every
transfer blocking; **1f1b**, with transfers overlapped; **eager-1f1b**, forward passes run ahead so transfers
hide behind compute; **eager-1f1b-wd**, with weight-gradient delaying; **signal**, the fastest of those
schedules with free transfers (the bound); and the share of the signal bound's throughput eager-1f1b and
eager-1f1b-wd reach.

{table(rows, ["case", "stages"] + list(PIPELINE_COLUMNS) + ["eager / signal", "eager-wd / signal"], "lrrrrrrrr")}

`xmesh-plan compare-schedules bench/pipelines/<case>.json` prints one case's full table (bubble, exposed
communication, weight delay, peak in-flight micro-batches per stage); Gantt charts of utrans-2.1b-fp16 are in
`bench/results/*.png` (`--png-dir`). With 16 micro-batches the fill and drain of a deep pipeline cross transfers
nothing can hide, so the share of the signal bound falls with the stage count.
"""


SECTIONS = (paper_cases, weight_sync, scale, frontier, verify_scale, executor_overhead, emulated, pipelines)


def render() -> str:
    return INTRO + "".join("\n" + section() for section in SECTIONS)


@click.command()
@click.option("--check", is_flag=True, help="do not write; exit 1 (with a diff) if BENCHMARKS.md differs from the results")
def main(check: bool) -> None:
    """Make BENCHMARKS.md from bench/results/*.json (or check that it is what they make)."""
    text = render()
    if check:
        current = DOC.read_text() if DOC.exists() else ""
        if current != text:
            click.echo("".join(difflib.unified_diff(current.splitlines(True), text.splitlines(True), "BENCHMARKS.md", "generated")))
            click.echo("BENCHMARKS.md is stale: run `make benchmarks-doc`", err=True)
            sys.exit(1)
        return
    from xmesh_plan.schemas.plan import write_atomic

    write_atomic(DOC, text)


if __name__ == "__main__":
    main()
