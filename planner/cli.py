"""The `xmesh-plan` command line: compile, inspect, verify, export, schema.

Bad input ends with one line naming the field and the fix, exit code 2, no traceback; a plan that
fails verification exits 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from xmesh_plan.schemas import Plan, ReshardingProblem, read_plan_file
from xmesh_plan.schemas.files import DataFileError
from xmesh_plan.schemas.last_resort import DEBUG_ENV, DEBUG_FLAG, run_guarded
from xmesh_plan.schemas.limits import quoted
from xmesh_plan.schemas.plan_check import check_plan
from xmesh_plan.schemas.plan_io import FORMATS, format_for, plan_file_bytes
from xmesh_plan.schemas.transfer import TransferProblem

from .cli_types import BUCKET_MB, SEED, STAGING_MB, TIME_LIMIT, max_tasks_option, write_output
from .cli_solvers import solver_summary
from .progress import QUIET_S, progress
from .compile_defaults import POSTED_STAGING_WARN_BYTES, CompileOptions
from .compile import compile_rows
from .inspect_plan import executor_summary, shared_summary, staging_summary, summarize
from .problem_io import InputError, build_problem, user_error_message
from .transfer_io import load_any_problem
from .solvers import SOLVERS
from .strategies import STRATEGIES
from .verify import PlanError, verify_plan, verify_plan_file


class UserError(click.ClickException):
    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class Group(click.Group):
    """Turns input errors raised anywhere in a command into a one-line message and exit code 2; run as the
    console script (`main()`), anything else becomes one internal-error line and exit 1 (schemas/last_resort.py)."""

    def __call__(self, *args, **kwargs):  # the console script's call; CliRunner calls .main() and sees tracebacks
        argv = kwargs.get("args", args[0] if args else None)
        argv = sys.argv[1:] if argv is None else list(argv)
        sys.exit(run_guarded(lambda: self.main(*args, **kwargs), "xmesh-plan", argv))

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as err:  # a bad flag value or command: one line too, with where to look
            where = f"{err.ctx.command_path} --help" if err.ctx else "xmesh-plan --help"
            raise UserError(f"{err.format_message().rstrip('.')}; see '{where}'") from None
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as err:
            message = user_error_message(err)
            if message is None:
                raise
            raise UserError(message) from None


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="xmesh-plan")
@click.option(DEBUG_FLAG, is_flag=True, expose_value=False,
              help=f"show the full traceback of an internal error (or set {DEBUG_ENV}=1)")
def main() -> None:
    """Plan, verify and inspect cross-mesh resharding.

    \b
    Example:
      xmesh-plan compile --shape 1024,1024,512 --dtype int32 --src-mesh 2x4 --src-spec "R S0 R" \\
                         --dst-mesh 2x4 --dst-spec "S0 R R" -o case3.plan.json
      xmesh-plan inspect case3.plan.json
      xmesh-plan verify case3.plan.json
    """


def problem_from_flags(problem_file, shape, dtype, src_mesh, src_spec, dst_mesh, dst_spec, max_tasks: int | None = None,
                       split_hosts: bool | None = None, merge: bool = True) -> ReshardingProblem | TransferProblem:
    flags = {"--shape": shape, "--src-mesh": src_mesh, "--src-spec": src_spec, "--dst-mesh": dst_mesh, "--dst-spec": dst_spec}
    if problem_file:
        given = [k for k, v in flags.items() if v is not None]
        if given:
            raise InputError(f"{given[0]}: give either a PROBLEM file or the flags, not both")
        return load_any_problem(problem_file, max_tasks, split_hosts, merge)
    missing = [k for k, v in flags.items() if v is None]
    if missing:
        raise InputError(f"{missing[0]}: missing; pass a PROBLEM file or all of {', '.join(flags)}")
    return build_problem({"shape": shape, "dtype": dtype, "src": {"mesh": src_mesh, "spec": src_spec},
                          "dst": {"mesh": dst_mesh, "spec": dst_spec}})


@main.command("compile")
@click.argument("problem_file", required=False, type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="where to write the plan ('-' for stdout); a name ending in .npz gets the compact format (docs/format.md)")
@click.option("--format", "fmt", type=click.Choice(list(FORMATS)),
              help="plan file format: json (readable) or compact (numpy columns with a per-device index, for large plans)  "
                   "[default: compact for an -o name ending in .npz, else json]")
@click.option("--shape", help="tensor shape, e.g. 1024,1024,512")
@click.option("--dtype", default="float32", show_default=True, help="element type, e.g. int32, bfloat16, float8_e4m3fn")
@click.option("--src-mesh", help="source mesh, AxB = A hosts of B devices, e.g. 2x4")
@click.option("--src-spec", help="source sharding spec, e.g. 'R S0 R'")
@click.option("--dst-mesh", help="destination mesh, placed on the hosts after the source's")
@click.option("--dst-spec", help="destination sharding spec, e.g. 'S0 R R'")
@click.option("--strategy", type=click.Choice(list(STRATEGIES) + ["auto"]), default="broadcast", show_default=True,
              help="communication strategy per unit task ('auto' picks the fastest per task)")
@click.option("--solver", type=click.Choice(list(SOLVERS)), default="auto", show_default=True,
              help="scheduler that picks sender hosts and orders (planner/solvers)")
@click.option("--seed", default=0, show_default=True, type=SEED, help="seed for randomized solvers (recorded in the plan)")
@click.option("--time-limit", default=10.0, show_default=True, type=TIME_LIMIT,
              help="solver budget in deterministic seconds (CP-SAT's deterministic time; no wall clock, so plans are reproducible)")
@click.option("--no-merge", is_flag=True, help="keep every cut-point cell as its own unit task")
@click.option("--split-hosts/--no-split-hosts", default=None,
              help="one unit task per receiving host, each sent from a holder on its own (weight sync: FSDP -> TP replicas), "
                   "except, for a multi-tensor problem, where that makes a source host send more than the byte bound (then one "
                   "chain through the hosts)  "
                   "[default: on for a multi-tensor problem, off for one tensor]")
@click.option("--coalesce/--no-coalesce", default=None,
              help="send small boxes between two hosts in bundles: gathered on one device, one cross-host message, scattered "
                   "[default: on for a multi-tensor problem, off for one tensor]")
@click.option("--bucket-mb", type=BUCKET_MB,
              help="when coalescing: the most MiB in one bundle (boxes above 1/8 of it are sent on their own)  "
                   "[default: 4, more on hosts whose NICs move more than 4 MiB in 80 us (8 x 400 Gbit/s: 32), or --max-staging-mb when less]")
@click.option("--cross-tensor/--no-cross-tensor", default=None,
              help="when coalescing: bundles of several tensors between the same two hosts share one cross-host message, "
                   "up to --bucket-mb  [default: on when a multi-tensor problem is coalesced]")
@click.option("--max-staging-mb", type=STAGING_MB,
              help="the most MiB of staging any device needs: larger staged boxes are cut, the plan states each device's "
                   "peak in device order, and on MPI runs posted within a window of N MiB per device; 0: no limit  "
                   "[default: no limit; a multi-tensor plan runs posted, "
                   f"every box staged at once, and compile says so where a device stages more than "
                   f"{POSTED_STAGING_WARN_BYTES // 2**20} MiB]")
@max_tasks_option
def compile_command(problem_file, output, fmt, shape, dtype, src_mesh, src_spec, dst_mesh, dst_spec, strategy, solver, seed, time_limit, no_merge,
                    split_hosts, coalesce, bucket_mb, cross_tensor, max_staging_mb, max_tasks):
    """Compile a resharding problem into a verified plan.

    A PROBLEM file with a `tensors` list moves many named tensors in one plan (docs/format.md); such a
    problem is compiled with --split-hosts --coalesce unless told otherwise, and its plan also states
    its time posted, the order the executor runs it in by default.

    \b
    Examples:
      xmesh-plan compile plans/case3.problem.json -o case3.plan.json
      xmesh-plan compile plans/weight_sync_small.problem.toml -o weight_sync_small.plan.json
      xmesh-plan compile plans/weight_sync_llama3_8b.problem.toml -o llama.plan.npz
      xmesh-plan compile --shape 1024,1024,512 --dtype int32 --src-mesh 2x4 --src-spec "R S0 R" \\
                         --dst-mesh 2x4 --dst-spec "S0 R R" -o case3.plan.json
    """
    problem = problem_from_flags(problem_file, shape, dtype, src_mesh, src_spec, dst_mesh, dst_spec, max_tasks, split_hosts, not no_merge)
    options = CompileOptions(strategy=strategy, solver=solver, seed=seed, time_limit_s=time_limit, merge=not no_merge,
                             max_tasks=max_tasks, split_hosts=split_hosts, coalesce=coalesce, cross_tensor=cross_tensor,
                             bucket_bytes=None if bucket_mb is None else int(bucket_mb * 2**20),
                             max_staging_bytes=_staging_bytes(max_staging_mb))
    if bucket_mb is not None and not options.for_problem(problem).coalesce:
        raise InputError("--bucket-mb sizes coalesced bundles, and this compile does not coalesce (a single tensor "
                         "coalesces only with --coalesce; --no-coalesce turns it off); add --coalesce or drop --bucket-mb")
    busiest: list[tuple[int, int]] = []
    with progress("compiling") as timing:
        plan = compile_rows(problem, options, on_stage=timing["stage"], on_posted_staging=lambda *d: busiest.append(d))
    if busiest and busiest[0][1] > POSTED_STAGING_WARN_BYTES and isinstance(problem, TransferProblem):
        click.echo(_posted_staging_note(*busiest[0]), err=True)
    fmt = fmt or ("json" if output in (None, "-") else format_for(output))
    if output and output != "-" and fmt == "compact":  # written from its rows, and the file is what is verified
        report = _write_verified(_plan_output(plan, output, fmt), output)
    else:
        plan = plan.to_plan()
        with progress("verifying", done_below_s=QUIET_S) as checking:
            report = verify_plan(plan, on_stage=checking["stage"], on_count=checking["count"])
        if output and _write_plan(plan, output, fmt) is None:
            return
    click.echo(f"{output or 'plan (not written: pass -o FILE to save it)'}: {len(plan.tasks)} unit tasks, {len(plan.operations)} operations"
               f"{shared_summary(plan)}, "
               f"predicted {plan.predicted_seconds:.4f} s{executor_summary(plan)}, lower bound {plan.lower_bound_seconds:.4f} s, "
               f"efficiency {plan.efficiency:.1%}; verified ({report.operations} operations replayed); "
               f"{solver_summary(plan, timing['seconds'])}{staging_summary(plan)}")


def _staging_bytes(mb: float | None) -> int | None:
    """`--max-staging-mb` in bytes: None when not given, 0 (no limit) only for 0 itself; any other value at least
    one byte, so a positive limit too small for one element is refused (`staging_limit`), never read as none."""
    if mb is None or mb == 0:
        return None if mb is None else 0
    return max(1, int(mb * 2**20))


def _posted_staging_note(device: int, nbytes: int) -> str:
    """compile's line (stderr) for a plan given no staging limit whose posted order stages more than
    POSTED_STAGING_WARN_BYTES on a device: the busiest one, and how to bound it."""
    return (f"note: posted (the MPI engine's default order for this multi-tensor plan), device {device} stages {nbytes / 2**30:.2f} GiB "
            f"at once; --max-staging-mb N bounds every device's staging to N MiB (the plan then runs posted within a window of "
            f"N MiB per device, BENCHMARKS.md 'Staging default'), or a smaller --bucket-mb stages less")


def _write_verified(data: bytes, output: str):
    """Write a compact plan file's bytes to `output` once, and return `verify_plan_file`'s report on them: proved from
    the temporary file that is then renamed over `output` (`write_output`), so a plan that fails is not written. Its
    columns are proved, not a record per operation (`planner.verify_columns`)."""
    reports = []

    def check(path: Path) -> None:
        with progress("verifying", done_below_s=QUIET_S) as checking:
            reports.append(verify_plan_file(path, on_stage=checking["stage"], on_count=checking["count"]))

    write_output(output, data, "--output", check=check)
    return reports[0]


def _plan_output(plan: Plan, output: str, fmt: str | None) -> bytes:
    """The bytes `-o output` gets: `fmt`, else what the name says (`-` for stdout: JSON); one line where too large."""
    try:
        return plan_file_bytes(plan, fmt or ("json" if output == "-" else format_for(output)))
    except DataFileError as err:
        raise InputError(f"--output: {err} ({len(plan.tasks):,} unit tasks, {len(plan.operations):,} operations)") from None


def _write_plan(plan: Plan, output: str, fmt: str | None) -> bytes | None:
    """Write `plan` where `-o output` says, as `fmt` or what the name says (`-`: stdout, JSON unless `fmt`), a file
    through a temporary one (`write_output`); the bytes written to a file, None for stdout (no summary line goes
    there). A plan too large for its format is one line (`_plan_output`)."""
    data = _plan_output(plan, output, fmt)
    if output == "-":
        sys.stdout.buffer.write(data)
        return None
    write_output(output, data, "--output")
    return data


@main.command("export")
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="where to write the plan ('-' for stdout); a name ending in .npz gets the compact format")
@click.option("--format", "fmt", type=click.Choice(list(FORMATS)),
              help="json or compact  [default: compact for an -o name ending in .npz, else json]")
def export_command(plan_file, output, fmt):
    """Write a plan (JSON or compact) in the other format: the same plan, read back equal.

    \b
    Examples:
      xmesh-plan export llama.plan.npz -o llama.plan.json
      xmesh-plan export plans/case3.plan.json -o case3.plan.npz
    """
    plan = read_plan_file(plan_file)
    data = _write_plan(plan, output, fmt)
    if data is not None:
        click.echo(f"{output}: {len(plan.operations)} operations, {len(data):,} bytes ({fmt or format_for(output)})")


@main.command("inspect")
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option("--tasks", "show_tasks", is_flag=True, help="list every unit task")
@click.option("--ops", "show_ops", is_flag=True, help="list every operation, one per line")
@click.option("--orders", "show_orders", is_flag=True,
              help="time the plan under each queueing: host-order, device-order (the executor's default), posted")
def inspect_command(plan_file, show_tasks, show_ops, show_orders):
    """Summarize a plan: tasks, bytes crossing hosts, per-host load, predicted time, lower bound, efficiency.

    \b
    Example:
      xmesh-plan inspect plans/case3.plan.json --tasks
    """
    plan = read_plan_file(plan_file)
    try:
        check_plan(plan)  # its sums index by tensor, device and host: a malformed plan gets one line, not a crash
    except PlanError as err:
        raise UserError(f"{quoted(plan_file)}: {err}; recompile it, or run `xmesh-plan verify {quoted(plan_file)}`") from None
    click.echo(summarize(plan, show_tasks=show_tasks, show_ops=show_ops, show_orders=show_orders))


@main.command("verify")
@click.argument("plan_files", nargs=-1, required=True, type=click.Path(dir_okay=False))
def verify_command(plan_files):
    """Prove plans deliver every byte: exit 1 naming the first wrong operation, device and box.

    \b
    Example:
      xmesh-plan verify plans/*.plan.json
    """
    failed = 0
    for path in plan_files:
        try:
            with progress(f"verifying {path}", done_below_s=QUIET_S) as timing:
                report = verify_plan_file(path, on_stage=timing["stage"], on_count=timing["count"])
        except PlanError as err:
            failed += 1
            click.echo(f"{quoted(path)}: FAILED: {err}")
            continue
        click.echo(f"{quoted(path)}: {report}")
    if failed:
        raise click.exceptions.Exit(1)


@main.command("schema")
@click.option("--of", "which", type=click.Choice(["plan", "problem", "transfer"]), default="plan", show_default=True,
              help="plan, single-tensor problem, or multi-tensor (transfer) problem")
def schema_command(which):
    """Print the JSON Schema of a plan or a (fully expanded) problem.

    \b
    Example:
      xmesh-plan schema --of plan > plan.schema.json
    """
    model = {"plan": Plan, "problem": ReshardingProblem, "transfer": TransferProblem}[which]
    click.echo(json.dumps(model.model_json_schema(), indent=1, sort_keys=True))


from .cli_pipeline import register as register_pipeline_commands  # noqa: E402  (pipeline commands, planner/cli_pipeline.py)
register_pipeline_commands(main)
from .cli_solvers import register as register_solver_commands  # noqa: E402  (compare, check: planner/cli_solvers.py)
register_solver_commands(main)

if __name__ == "__main__":
    main()
