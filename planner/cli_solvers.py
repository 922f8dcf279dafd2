"""CLI commands about solvers: `compare` every solver and baseline on one problem, `check` a plan's quality.

`register(main)` adds them to the `xmesh-plan` group. Solve times are wall clock on this machine and
appear only here, never in a plan (plans stay byte-identical).
"""

from __future__ import annotations

import time

import click
from tabulate import tabulate

from xmesh_plan.schemas import read_plan_file
from xmesh_plan.schemas.limits import quoted

from .audit import audit_plan
from .progress import progress
from .cli_types import POSITIVE, SEED, TIME_LIMIT, max_tasks_option
from .baselines import BASELINES, baseline_seconds
from .compile import compile_plan
from .executor_order import executor_order
from .inspect_plan import indented
from .transfer_io import load_any_problem
from .solvers import SOLVERS
from .unit_tasks import DEFAULT_MAX_TASKS
from .verify import PlanError, verify_plan
from .bounds import lower_bound, over_bound
from .unit_tasks import decompose
from xmesh_plan.schemas.transfer import TransferProblem


def solver_summary(plan, seconds: float) -> str:
    """`auto (winner list-backfill, gap 0.0000) in 0.02 s`: what chose the order and how well."""
    details = plan.solver.details
    winner = f"winner {details['winner']}, " if "winner" in details else ""
    gap = details.get("gap_to_proven_bound")
    gap = f"schedule gap to proven bound {float(gap):.4f}" if gap is not None else "no proven bound"
    return f"solver {plan.solver.name} ({winner}{gap}) in {seconds:.2f} s"


def compare_rows(problem, seed: int, time_limit: float, max_tasks: int | None = DEFAULT_MAX_TASKS) -> list[tuple[str, float, float | None, float]]:
    """(name, predicted seconds, lower bound, wall seconds) for every solver and every baseline."""
    rows = []
    for name in SOLVERS:
        begin = time.perf_counter()
        plan = compile_plan(problem, solver=name, seed=seed, time_limit_s=time_limit, max_tasks=max_tasks)
        rows.append((f"broadcast + {name}", plan.predicted_seconds, plan.lower_bound_seconds, time.perf_counter() - begin))
    for name in BASELINES:
        begin = time.perf_counter()
        rows.append((name, baseline_seconds(problem, name, max_tasks), None, time.perf_counter() - begin))
    return rows


def register(group: click.Group) -> None:
    group.add_command(compare_command)
    group.add_command(check_command)


@click.command("compare")
@click.argument("problem_file", type=click.Path(dir_okay=False))
@click.option("--seed", default=0, show_default=True, type=SEED, help="seed for randomized solvers")
@click.option("--time-limit", default=10.0, show_default=True, type=TIME_LIMIT, help="solver budget in deterministic seconds")
@max_tasks_option
def compare_command(problem_file, seed, time_limit, max_tasks):
    """Every solver and every baseline (Alpa's two, the RL frameworks' rank-0 gather-broadcast and
    per-rank broadcast; planner/baselines.py) on one problem, predicted by the same simulator.

    \b
    Example:
      xmesh-plan compare plans/case3.problem.json
    """
    problem = load_any_problem(problem_file, max_tasks)
    with progress(f"comparing {len(SOLVERS)} solvers and {len(BASELINES)} baselines"):
        rows = compare_rows(problem, seed, time_limit, max_tasks)
    bound = next(b for _, _, b, _ in rows if b is not None)
    best = min(p for _, p, _, _ in rows)
    unit, scale = _time_unit(max(p for _, p, _, _ in rows))
    table = [(name, predicted * scale, _over_bound_of_row(predicted, bound, best), _over_best(predicted, best), wall)
             for name, predicted, _, wall in rows]
    click.echo(tabulate(table, headers=("approach", f"predicted {unit}", "/ bound", "/ best", "wall s"), tablefmt="plain",
                        floatfmt=("", ".4f", ".3f", ".3f", ".2f"), missingval="-"))
    if any(row[2] is None for row in table):
        click.echo("/ bound: '-' where the bound is 0 (nothing need cross a link) and this approach takes longer than the "
                   f"best: compare the predicted {unit} instead")
    if any(row[3] is None for row in table):
        click.echo("/ best: '-' where the best approach takes 0 s (nothing crosses a link) and this one longer: "
                   f"compare the predicted {unit} instead")
    click.echo(f"lower bound {bound:.4f} s")


def _time_unit(longest: float) -> tuple[str, float]:
    """The unit the predicted column shows times in, and its factor: seconds, or microseconds where every time is
    below a millisecond (so times that would all print as 0.0000 s stay apart)."""
    return ("s", 1.0) if longest >= 1e-3 else ("us", 1e6)


def _over_bound_of_row(seconds: float, bound: float, best: float) -> float | None:
    """`over_bound`, but None (no ratio) where the bound is 0 and this approach takes longer than the best: its 1.0
    says a plan cannot do better, which holds only for the best approach when nothing need cross a link."""
    return over_bound(seconds, bound) if bound > 0 or seconds <= best else None


def _over_best(seconds: float, best: float) -> float | None:
    """`seconds` over the best approach's: 1.0 where both are 0 (nothing to move), None (no ratio) where only the
    best is 0."""
    if best > 0:
        return seconds / best
    return 1.0 if seconds <= 0 else None


@click.command("check")
@click.argument("plan_files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--max-ratio", default=1.1, show_default=True, type=POSITIVE,
              help="fail when predicted time exceeds this times the lower bound (or the reference's predicted time); a "
                   "multi-tensor plan's time in the executor's default order for it (posted, or device order under a "
                   "staging limit) counts too")
@click.option("--reference", type=click.Path(dir_okay=False), help="a reference plan to compare predicted times with")
@click.option("--tensors", "per_tensor", is_flag=True, help="multi-tensor plans: also a row per tensor (when it is done, its own bound)")
@click.option("--simulate", "any_size", is_flag=True,
              help="multi-tensor plans: time the executor's default order by the simulator whatever the plan's size, and gate "
                   "on it (a plan over compile's simulation limits otherwise is not: a full frontier plan takes minutes and GiBs); "
                   "the host-order times of such a plan stay unchecked")
def check_command(plan_files, max_ratio, reference, per_tensor, any_size):
    """Exit 1 when a plan fails verification, when its stored times or bound disagree with what they
    recompute to, or when it is more than --max-ratio over its lower bound or a reference plan (for CI).
    A multi-tensor plan is also timed in the order the executor runs it by default (posted, or device order
    where it states a staging limit), and that time is gated too. A plan is re-simulated where compile would
    simulate it (the same message count and work budget); otherwise its stored times are reported unchecked, and
    the line says why.

    \b
    Example:
      xmesh-plan check plans/*.plan.json --max-ratio 1.05
    """
    ref = _audited(reference, read_plan_file(reference), any_size) if reference else None
    if isinstance(ref, str):
        raise click.UsageError(f"--reference: {ref}")
    failed = 0
    for path in plan_files:
        plan = read_plan_file(path)
        audit = _audited(path, plan, any_size)
        if isinstance(audit, str):
            click.echo(f"{quoted(path)}: FAIL {audit}")
            failed += 1
            continue
        predicted, bound = audit.predicted_seconds, audit.lower_bound_seconds
        over = over_bound(predicted, bound)
        problems = [f"{over:.4f}x its lower bound"] if over > max_ratio else []
        executed = audit.executor_seconds
        over_executed = over_bound(executed, bound) if executed is not None else None
        order = executor_order() + (" within the staging limit" if plan.staging is not None else "")
        if over_executed is not None and over_executed > max_ratio:
            problems.append(f"{over_executed:.4f}x its lower bound {order} (the executor's default order)")
        if ref is not None and predicted > max_ratio * ref.predicted_seconds:
            ratio = _over_best(predicted, ref.predicted_seconds)
            problems.append(f"{ratio:.4f}x the reference {reference}" if ratio is not None else
                            f"{predicted:.4g} s where the reference {reference} takes 0 s")
        status = "FAIL " + "; ".join(problems) if problems else "ok"
        status += _unchecked_note(plan, audit)
        stated = plan.executor_prediction
        posted = f", {order} (executor default) {executed:.4f} s ({over_executed:.4f}x)" if executed is not None else \
            (f", {order} (executor default) {stated.predicted_seconds:.4f} s as stored, not re-simulated, not gated; "
             "`xmesh-plan check --simulate` times it" if audit.unsimulated and stated is not None else
             f", {order} (executor default) not timed: too costly to simulate here, not gated; `xmesh-plan check "
             "--simulate` times it" if isinstance(plan.problem, TransferProblem) else "")
        click.echo(f"{quoted(path)}: predicted {predicted:.4f} s, bound {bound:.4f} s ({over:.4f}x){posted} {status}")
        if per_tensor:
            click.echo("\n".join(tensor_check_rows(plan)))
        failed += bool(problems)
    if failed:
        raise click.exceptions.Exit(1)


def tensor_check_rows(plan) -> list[str]:
    """Per tensor of a multi-tensor plan: its tasks, when its last operation ends, and its own lower bound
    (the bound were it moved alone); none for a single-tensor plan."""
    if not isinstance(plan.problem, TransferProblem):
        return []
    done = [0.0] * len(plan.problem.tensors)
    tasks = [0] * len(plan.problem.tensors)
    for op in plan.operations:
        done[op.tensor] = max(done[op.tensor], op.end_s)
    for task in plan.tasks:
        tasks[task.tensor] += 1
    rows = [(single.name, tasks[i], f"{done[i]:.4f}",
             f"{lower_bound(decompose(single, max_tasks=None), single.cluster, single.itemsize).seconds:.4f}")
            for i, single in enumerate(plan.problem.tensor_problems())]
    rows = indented(rows, ("tensor", "tasks", "done at s", "own bound s"), colalign=("left", "right", "right", "right"))
    return rows


def _unchecked_note(plan, audit) -> str:
    """Which stored times `check` did not re-simulate and why, naming what timed the plan when compiled; empty for a
    re-simulated plan."""
    if audit.retimed:
        return ""
    return (f" (stored host-order times not re-simulated: {audit.unsimulated}; compiled timed by "
            f"{plan.solver.details.get('timed_by', 'an unstated method')})")


def _audited(path: str, plan, any_size: bool = False):
    """The plan's recomputed figures, or a one-line reason it cannot be trusted (`any_size`: `audit_plan`'s)."""
    try:
        verify_plan(plan)
    except PlanError as err:
        return f"does not verify: {err}"
    audit = audit_plan(plan, any_size)
    return f"{audit.mismatch}; recompile the plan" if audit.mismatch else audit
