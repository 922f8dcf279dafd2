"""Pipeline commands of `xmesh-plan`: schedule, simulate, compare-schedules.

`register(group)` adds them to the main click group. Bad input ends with one line and exit code 2.
"""

from __future__ import annotations

import functools
import json

import click

from .pipeline.build import build_schedule
from .pipeline.compare import compare, format_table
from .pipeline.costs import default_plan_fn, signal_costs, transfer_costs
from .pipeline.io import load_pipeline, load_schedule
from .pipeline.schedules import SCHEDULE_NAMES, WEIGHT_DELAY_SUFFIX, parse_schedule_name
from .pipeline.simulate import Metrics, evaluate, schedule_actions
from .pipeline.torch_csv import TORCH_FORMATS, check_torch_chain, torch_csv
from .pipeline.trace import trace_json
from .cli_types import SEED, max_actions_option, max_tasks_option, output_error, write_output
from .problem_io import InputError
from .solvers import SOLVERS
from .strategies import STRATEGIES


def _as_input_error(func):
    """Schedule and action errors come from the user's files: report them as one-line input errors."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except InputError:
            raise
        except (ValueError, KeyError) as err:
            if type(err).__module__.startswith("pydantic"):
                raise
            # str(KeyError) wraps its message in quotes; a ValueError's text is shown as is (it may end in a quote)
            raise InputError(str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)) from None
    return wrapper


def _torch_chain(pipeline) -> None:
    try:
        check_torch_chain(pipeline)
    except ValueError as err:
        raise InputError(f"--torch-csv: {err}") from None


def _costs(pipeline, strategy: str, solver: str, seed: int, max_tasks: int):
    return transfer_costs(pipeline, default_plan_fn(strategy, solver, seed, max_tasks))


def describe(metrics: Metrics) -> str:
    peak = " ".join(map(str, metrics.peak_in_flight))
    return (f"iteration {metrics.iteration_s * 1e3:.3f} ms, bubble {metrics.bubble_fraction:.1%}, "
            f"exposed communication {metrics.exposed_comm_s * 1e3:.3f} ms, peak in-flight micro-batches per stage {peak}")


_plan_options = [  # as for `compile`: same names, choices and defaults
    click.option("--strategy", type=click.Choice(list(STRATEGIES) + ["auto"]), default="broadcast", show_default=True,
                 help="resharding strategy for every transfer's plan ('auto' picks the fastest per task)"),
    click.option("--solver", type=click.Choice(list(SOLVERS)), default="auto", show_default=True,
                 help="resharding scheduler for every transfer's plan (planner/solvers)"),
    click.option("--seed", default=0, show_default=True, type=SEED, help="seed for randomized solvers"),
    max_tasks_option,
    max_actions_option,
]


def check_schedule_size(pipeline, split_backward: bool, max_actions: int) -> None:
    """Refuse, before anything is planned, a pipeline whose schedule lays out more than `max_actions` compute actions
    (time and memory grow with them: 64 stages x 2,000 micro-batches took minutes and GBs)."""
    per = 3 if split_backward else 2  # F and B, or F, I and W
    actions = len(pipeline.stages) * pipeline.micro_batches * per
    if actions > max_actions:
        raise InputError(f"pipeline: {len(pipeline.stages)} stages x {pipeline.micro_batches} micro-batches x {per} gives "
                         f"{actions:,} compute actions, above the limit of {max_actions:,}; pass --max-actions {actions} if "
                         "this machine has the time, or give fewer micro-batches")


def parse_weight_delay(text: str, name: str, stages: int, micro_batches: int) -> tuple[int, ...]:
    """`--weight-delay 0,2` for a `-wd` schedule: one delay per stage, each 0 .. 2*micro_batches - 1."""
    most = 2 * micro_batches - 1  # a stage has 2m compute actions; a W moved past all the others is at the end
    example = ",".join(str(min(i, most)) for i in range(stages))
    if not parse_schedule_name(name)[1]:
        raise InputError(f"--weight-delay: schedule {name} does not split the backward, so it has no weight delay; "
                         f"use --schedule {name}{WEIGHT_DELAY_SUFFIX} or drop --weight-delay")
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isascii() and p.isdigit() for p in parts):
        raise InputError(f"--weight-delay {text[:40]!r}: give one non-negative integer per stage, e.g. --weight-delay {example}")
    too_big = [p for p in parts if len(p.lstrip("0")) > len(str(most)) or int(p) > most]  # short-circuit: no int() of 5,000 digits
    if too_big:
        raise InputError(f"--weight-delay {text[:40]!r}: {too_big[0][:20]} is more than {most}, the compute actions a weight part can "
                         f"be moved behind with {micro_batches} micro-batches; e.g. --weight-delay {example}")
    delays = tuple(int(p) for p in parts)
    if len(delays) != stages:
        raise InputError(f"--weight-delay {text[:40]!r}: {len(delays)} entries for {stages} stages; give one per stage, "
                         f"e.g. --weight-delay {example}")
    return delays


def plan_options(func):
    for option in reversed(_plan_options):
        func = option(func)
    return func


@click.command("schedule")
@click.argument("pipeline_file", type=click.Path(dir_okay=False))
@click.option("--schedule", "name", type=click.Choice(SCHEDULE_NAMES), default="eager-1f1b", show_default=True)
@click.option("--no-overlap", is_flag=True, help="every send holds its stage until the transfer ends")
@click.option("--signal", is_flag=True, help="make every transfer free: the 'signal send/recv' bound")
@click.option("--weight-delay", help="for -wd schedules only: per-stage delays in compute actions, e.g. 0,1 "
              "(default: chosen by the cost model)")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="where to write the schedule JSON ('-' for stdout)")
@click.option("--torch-csv", "torch_csv_path", type=click.Path(dir_okay=False), help="also write the schedule as the CSV that "
              "torch.distributed.pipelining's _PipelineScheduleRuntime._load_csv reads (chain pipelines only)")
@click.option("--torch-format", type=click.Choice(TORCH_FORMATS), default="compute_only", show_default=True,
              help="compute_only: torch places sends and receives; compute_comms: ours, where this schedule puts them")
@plan_options
@_as_input_error
def schedule_command(pipeline_file, name, no_overlap, signal, weight_delay, output, torch_csv_path, torch_format,
                     strategy, solver, seed, max_tasks, max_actions):
    """Plan every transfer of a pipeline and lay out one schedule; validated before it is written.

    \b
    Examples:
      xmesh-plan schedule bench/pipelines/utrans-2.1b-fp16.json --schedule eager-1f1b-wd -o schedule.json
      xmesh-plan schedule bench/pipelines/gpt-2.6b-4stage-fp16.json --torch-csv schedule.csv
    """
    pipeline = load_pipeline(pipeline_file)
    check_schedule_size(pipeline, parse_schedule_name(name)[1], max_actions)
    if torch_csv_path:
        _torch_chain(pipeline)
    delays = None if weight_delay is None else parse_weight_delay(weight_delay, name, len(pipeline.stages), pipeline.micro_batches)
    costs = _costs(pipeline, strategy, solver, seed, max_tasks)
    schedule = build_schedule(pipeline, name, signal_costs(costs) if signal else costs, not no_overlap, delays)
    if torch_csv_path:
        write_output(torch_csv_path, torch_csv(schedule_actions(schedule), torch_format), "--torch-csv")
    if output == "-":
        click.echo(schedule.to_json(), nl=False)
        return
    if output:
        write_output(output, schedule.to_json(), "--output")
    delay = f", weight delay {','.join(map(str, schedule.weight_delay))}" if schedule.weight_delay else ""
    click.echo(f"{output or name}: {name}{delay}; {describe(evaluate(schedule)[1])}")
    if torch_csv_path:
        click.echo(f"{torch_csv_path}: torch schedule CSV; load it with "
                   f"_PipelineScheduleRuntime(...)._load_csv({torch_csv_path!r}, format={torch_format!r})")


@click.command("simulate")
@click.argument("schedule_file", type=click.Path(dir_okay=False))
@click.option("--trace", type=click.Path(dir_okay=False), help="write a Chrome/Perfetto trace JSON here")
@click.option("--png", type=click.Path(dir_okay=False), help="write a Gantt chart PNG here (needs matplotlib)")
@click.option("--json", "as_json", is_flag=True, help="print the metrics as JSON")
@click.option("--show", is_flag=True, help="print each stage's actions, one line per stage")
@_as_input_error
def simulate_command(schedule_file, trace, png, as_json, show):
    """Replay a schedule: iteration time, bubble, exposed communication, peak in-flight activations.

    \b
    Example:
      xmesh-plan simulate schedule.json --trace out.json --png out.png
    """
    schedule = load_schedule(schedule_file)
    timeline, metrics = evaluate(schedule)
    if trace:
        write_output(trace, trace_json(timeline, {"schedule": schedule.schedule, **metrics.as_dict()}), "--trace")
    if png:
        from .pipeline.gantt import draw_gantt

        try:
            draw_gantt(timeline, png, f"{schedule.pipeline.name or 'pipeline'}: {schedule.schedule} — {describe(metrics)}")
        except RuntimeError as err:
            raise InputError(f"--png: {err}") from None
        except OSError as err:
            raise output_error(err, png, "--png") from None
    if show:
        for line in schedule.stages:
            click.echo(line)
    click.echo(json.dumps(metrics.as_dict(), sort_keys=True) if as_json else f"{schedule.schedule}: {describe(metrics)}")


@click.command("compare-schedules")
@click.argument("pipeline_file", type=click.Path(dir_okay=False))
@plan_options
@_as_input_error
def compare_command(pipeline_file, strategy, solver, seed, max_tasks, max_actions):
    """Every schedule on one pipeline in one table, against the signal bound (free transfers).

    \b
    Example:
      xmesh-plan compare-schedules bench/pipelines/utrans-2.1b-fp16.json
    """
    pipeline = load_pipeline(pipeline_file)
    check_schedule_size(pipeline, True, max_actions)
    click.echo(format_table(compare(pipeline, _costs(pipeline, strategy, solver, seed, max_tasks))))


def register(group: click.Group) -> None:
    """Add the pipeline commands to `group` (the `xmesh-plan` main group)."""
    for command in (schedule_command, simulate_command, compare_command):
        group.add_command(command)

