"""The compact plan file (`schemas.plan_compact`): any plan round-trips to the same `Plan` and the same bytes, a
device's operations come back through the index, and damaged or foreign files get one line naming the fix."""

from __future__ import annotations

import random
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from pydantic import ValidationError

from xmesh_plan.schemas import Plan, PlanFileError, read_plan_file
from xmesh_plan.schemas.files import write_atomic
from xmesh_plan.executor.plan_index import plan_index
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.verify_columns import verify_compact
from xmesh_plan.schemas.plan import HostOrder, Operation, UnitTask
from xmesh_plan.schemas.plan_compact import COLUMN_KINDS, archive_bytes, compact_arrays, compact_bytes
from xmesh_plan.schemas.op_kinds import number_tags
from xmesh_plan.schemas.plan_io import plan_file_bytes, read_plan_ops
from tests.support.cases import compiled
from tests.support.cli import assert_user_error, run_cli
from tests.support.mutations import as_lists, mutate
from tests.support.strategies import SETTINGS, problems
from tests.support.transfer import three_tensors

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = sorted((ROOT / "plans").glob("*.plan.json"))


def _round_trip(plan: Plan, tmp_path: Path, name: str = "x.plan.npz") -> Plan:
    path = tmp_path / name
    write_atomic(path, compact_bytes(plan))
    back = read_plan_file(path)
    assert back == plan
    assert back.to_json() == plan.to_json()
    assert compact_bytes(back) == path.read_bytes()  # the same plan, the same bytes
    return back


def _devices(op: Operation) -> set[int]:
    return {d for d in (op.src, *op.dsts, *op.holders, *(d for g in op.needers for d in g)) if d is not None}


def test_columns_cover_every_field():
    """A field added to a plan record without a column would be dropped by the compact file."""
    for table, model in (("operations", Operation), ("tasks", UnitTask), ("host_order", HostOrder)):
        assert set(COLUMN_KINDS[table]) == set(model.model_fields), table


@pytest.mark.parametrize("path", REFERENCE, ids=lambda p: p.name)
def test_reference_plans_round_trip(path, tmp_path):
    plan = read_plan_file(path)
    _round_trip(plan, tmp_path)
    assert compact_bytes(plan) == compact_bytes(read_plan_file(path))  # byte-identical for the same plan
    operations = sum(a.nbytes for k, a in compact_arrays(plan).items() if k.startswith(("operations.", "index.")))
    if len(plan.operations) >= 50:  # one-operation plans pay for the index's fixed entries alone
        assert operations <= 100 * len(plan.operations)  # the budget: about 100 bytes per operation


@given(problems())
@settings(max_examples=25, **SETTINGS)
def test_random_plans_round_trip(problem):
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        for strategy in ("broadcast", "global_allgather"):
            _round_trip(compiled(problem, strategy), Path(folder))


def test_odd_values_round_trip(tmp_path):
    """Mutated plans the schema accepts (negative devices, huge bounds, NaN times, None fields) come back as written."""
    rng = random.Random(7)
    base = read_plan_file(ROOT / "plans" / "case4.plan.json")
    done = 0
    for _ in range(60):
        raw = as_lists(base.model_dump(mode="json"))
        mutate(rng, raw)
        try:
            plan = Plan.model_validate(raw)
        except ValidationError:
            continue
        path = tmp_path / "m.plan.npz"
        write_atomic(path, compact_bytes(plan))
        back = read_plan_file(path)
        assert back.to_json() == plan.to_json()
        done += 1
    assert done >= 30


def test_a_bundle_plan_takes_under_100_bytes_per_operation():
    """Every member but the header (the problem's JSON), over the operations, of a plan of bundles only (84 of them,
    with their tasks, host order and index): the issue's budget is about 100 bytes per operation."""
    plan = read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json")
    assert {op.kind for op in plan.operations} == {"bundle"}
    arrays = compact_arrays(plan)
    assert sum(a.nbytes for name, a in arrays.items() if name != "header") <= 100 * len(plan.operations)


def test_shared_tables_keep_every_time_bit_and_box(tmp_path):
    """Boxes are written once (`boxes.*`) and indexed; times go through the shared `floats` table only where that is
    smaller, and keep their exact bits either way (-0.0 stays -0.0)."""
    plan = read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json")
    arrays = compact_arrays(plan)
    distinct = {op.region for op in plan.operations} | {t.region for t in plan.tasks} | {b for op in plan.operations for b in op.parts}
    assert len(arrays["boxes.dims"]) == len(distinct) < len(plan.operations) + len(plan.tasks)
    assert "floats" in arrays and "operations.start_s" not in arrays  # 84 operations share few distinct times
    assert 8 * len(arrays["floats"]) + sum(arrays[f"{t}.{f}.at"].nbytes for t in ("operations", "tasks") for f in ("start_s", "end_s")) \
        < 8 * 2 * (len(plan.operations) + len(plan.tasks))
    ops = tuple(op.model_copy(update={"start_s": float(k) * 1e-7 + 1e-9 * (k % 3), "end_s": -0.0 if k == 0 else float(k) * 2e-7})
                for k, op in enumerate(plan.operations))
    tasks = tuple(t.model_copy(update={"start_s": k * 1e-7 + 5e-10, "end_s": k * 3e-7 + 7e-10}) for k, t in enumerate(plan.tasks))
    unique = plan.model_copy(update={"operations": ops, "tasks": tasks})  # every time distinct: direct columns are smaller
    arrays = compact_arrays(unique)
    assert "floats" not in arrays and arrays["operations.start_s"].dtype == np.float64
    back = _round_trip(unique, tmp_path)
    assert str(back.operations[0].end_s) == "-0.0"


def test_big_integers_pick_wider_columns(tmp_path):
    plan = read_plan_file(ROOT / "plans" / "case1.plan.json")
    op = plan.operations[0].model_copy(update={"id": 2**40, "task": -(2**35), "chunks": 70000})
    plan = plan.model_copy(update={"operations": (op, *plan.operations[1:])})
    arrays = compact_arrays(plan)
    assert arrays["operations.id"].dtype == np.int64 and arrays["operations.chunks"].dtype == np.int32
    _round_trip(plan, tmp_path)


@pytest.mark.parametrize("name", ["case4.plan.json", "weight_sync_small.plan.json"])
def test_device_ops_match_the_whole_plan(name, tmp_path):
    plan = read_plan_file(ROOT / "plans" / name)
    path = tmp_path / "x.plan.npz"
    write_atomic(path, compact_bytes(plan))
    devices = set().union(*(_devices(op) for op in plan.operations))
    for device in sorted(devices) + [10_000]:
        part = read_plan_ops(path, device)
        want = [i for i, op in enumerate(plan.operations) if device in _devices(op)]
        assert part.rows == tuple(want)
        assert part.operations == tuple(plan.operations[i] for i in want)
        assert part.problem == plan.problem and part.schema_version == plan.schema_version
        index = plan_index(plan)  # the executor's own numbering: a rank reading only its part must match its peers
        assert part.first_tags == tuple(index.first_tag[i] for i in want) and part.tags == index.tags
        assert read_plan_ops(ROOT / "plans" / name, device) == part  # a JSON plan gives the same


def test_read_by_content_not_name(tmp_path):
    plan = read_plan_file(ROOT / "plans" / "case3.plan.json")
    path = tmp_path / "plan.json"  # compact bytes under a JSON name
    write_atomic(path, compact_bytes(plan))
    assert read_plan_file(path) == plan
    json_named_npz = tmp_path / "plan.npz"
    write_atomic(json_named_npz, plan.to_json())
    assert read_plan_file(json_named_npz) == plan


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    good = compact_bytes(read_plan_file(ROOT / "plans" / "case4.plan.json"))
    files = {"truncated": good[: len(good) // 2], "cut-at-end": good[:-10], "header-only": good[:200]}
    flipped = bytearray(good)
    header_at = good.index(b"xmesh-plan-compact")
    flipped[header_at:header_at + 5] = b"XXXXX"
    files["foreign-format"] = bytes(flipped)
    out = {k: tmp_path / f"{k}.plan.npz" for k in files}
    for k, data in files.items():
        out[k].write_bytes(data)
    np.savez(tmp_path / "other.npz", a=np.arange(3))
    out["other-npz"] = tmp_path / "other.npz"
    with zipfile.ZipFile(tmp_path / "text.zip", "w") as archive:
        archive.writestr("readme.txt", "hello")
    out["zip-of-text"] = tmp_path / "text.zip"
    with zipfile.ZipFile(tmp_path / "pickled.npz", "w") as archive:  # an object array: numpy would need pickle to read it
        with archive.open("header.npy", "w") as member:
            np.lib.format.write_array(member, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    out["object-array"] = tmp_path / "pickled.npz"
    return out


def test_damaged_and_foreign_files_get_one_line(tmp_path):
    for what, path in _bad_files(tmp_path).items():
        with pytest.raises(PlanFileError) as err:
            read_plan_file(path)
        message = str(err.value)
        assert "\n" not in message and str(path) in message and "xmesh-plan compile" in message, (what, message)
        with pytest.raises(PlanFileError):
            read_plan_ops(path, 0)
        for command in ("verify", "inspect", "check"):
            assert_user_error(run_cli(command, path), str(path.name))


def _tampered_indexes(plan: Plan, tmp_path: Path) -> dict[str, Path]:
    """Files whose tables are the plan's but whose per-device index is not: a send dropped from its sender's rows,
    and every operation's first message tag 0."""
    k, op = next((i, o) for i, o in enumerate(plan.operations) if o.kind in ("send", "broadcast") and o.src not in o.dsts)
    arrays = compact_arrays(plan)
    offsets, first, steps = (arrays[f"index.{m}"].astype(np.int64) for m in ("offsets", "first", "rows"))
    lists = [(first[i] + np.cumsum(steps[offsets[i]:offsets[i + 1]])).tolist() for i in range(len(first))]
    lists[arrays["index.devices"].tolist().index(op.src)].remove(k)
    dropped = dict(arrays, **{"index.offsets": np.cumsum([0, *map(len, lists)]).astype(arrays["index.offsets"].dtype),
                              "index.rows": np.concatenate([np.diff(rows, prepend=rows[0]) for rows in lists]).astype(steps.dtype)})
    tags = arrays["index.first_tags"].copy()
    tags[:-1] = 0
    out = {"index.rows": dropped, "index.first_tags": dict(arrays, **{"index.first_tags": tags})}
    for member, members in out.items():
        out[member] = tmp_path / f"{member}.plan.npz"
        out[member].write_bytes(archive_bytes(members))
    return out


def test_a_tampered_index_is_refused_by_the_whole_file_read_and_verify(tmp_path):
    plan = compile_plan(three_tensors(), strategy="auto", seed=0)
    quiet = lambda *_: None
    written = tmp_path / "as_written.plan.npz"
    write_atomic(written, compact_bytes(plan))
    assert verify_compact(written, quiet, quiet) is not None  # the columns prove the file as written
    for member, path in _tampered_indexes(plan, tmp_path).items():
        assert verify_compact(path, quiet, quiet) is None  # left to the record path, which refuses it
        with pytest.raises(PlanFileError) as err:
            read_plan_file(path)
        message = str(err.value)
        assert "\n" not in message and f"{member}.npy" in message and "xmesh-plan export" in message, message
        for command in ("verify", "inspect", "check"):
            assert_user_error(run_cli(command, path), path.name, f"{member}.npy", "recompile")


def test_compile_writes_compact_and_export_round_trips(tmp_path):
    problem = ROOT / "plans" / "weight_sync_small.problem.toml"
    compact = tmp_path / "ws.plan.npz"
    assert run_cli("compile", problem, "-o", compact).exit_code == 0
    assert compact.read_bytes().startswith(b"PK\x03\x04")
    json_out = tmp_path / "ws.json"
    assert run_cli("export", compact, "-o", json_out).exit_code == 0
    assert json_out.read_text() == (ROOT / "plans" / "weight_sync_small.plan.json").read_text()
    again = tmp_path / "again.bin"
    assert run_cli("export", json_out, "-o", again, "--format", "compact").exit_code == 0
    assert again.read_bytes() == compact.read_bytes()
    for command in ("verify", "inspect", "check"):
        result = run_cli(command, compact)
        assert result.exit_code == 0, result.output


def test_json_writer_refuses_what_its_readers_refuse(monkeypatch, tmp_path):
    from xmesh_plan.schemas import files

    plan = read_plan_file(ROOT / "plans" / "case4.plan.json")
    monkeypatch.setattr(files, "MAX_FILE_BYTES", 1000)
    with pytest.raises(files.DataFileError, match="write it compact instead"):
        plan_file_bytes(plan, "json")
    assert plan_file_bytes(plan, "compact")
    monkeypatch.setattr(files, "MAX_COMPACT_FILE_BYTES", 1000)
    with pytest.raises(files.DataFileError, match="split the problem"):
        plan_file_bytes(plan, "compact")
    path = tmp_path / "x.plan.npz"
    path.write_bytes(compact_bytes(plan))
    assert_user_error(run_cli("verify", path), "MiB", "split the problem")


def test_a_bad_record_gets_the_json_plan_s_message(tmp_path):
    """A compact file whose operation states what the schema refuses is refused as its JSON would be."""
    plan = read_plan_file(ROOT / "plans" / "case4.plan.json")
    arrays = compact_arrays(plan)
    arrays["operations.kind.names"] = np.frombuffer(b'["teleport"]', dtype=np.uint8)
    compact = tmp_path / "bad.plan.npz"
    compact.write_bytes(archive_bytes(arrays))
    raw = as_lists(plan.model_dump(mode="json"))
    for op in raw["operations"]:
        op["kind"] = "teleport"
    import json

    text = tmp_path / "bad.plan.json"
    text.write_text(json.dumps(raw))
    messages = []
    for path in (compact, text):
        with pytest.raises(PlanFileError) as err:
            read_plan_file(path)
        messages.append(str(err.value).replace(str(path), "PATH"))
    assert messages[0] == messages[1] and "kind" in messages[0]


def test_a_plan_through_a_pipe_is_read_once(tmp_path):
    """`xmesh-plan verify <(cat plan.json)`: telling the formats apart must not eat the pipe's first bytes."""
    import os
    import threading

    source = ROOT / "plans" / "case3.plan.json"
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(source.read_bytes()))
    writer.start()
    try:
        assert read_plan_file(fifo) == read_plan_file(source)
    finally:
        writer.join(timeout=30)


def test_a_rank_s_operations_are_the_records_validation_makes(tmp_path):
    """`read_plan_ops` makes a compact file's rows into records without validating each one (`plan_io._trusted_operation`)
    where the columns are integers and every row's kind and bounds hold: the records are the validated ones, field for
    field, with the same fields set, and the only constraints `Operation` states are the ones checked that way."""
    plan = read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json")
    path = tmp_path / "x.plan.npz"
    write_atomic(path, compact_bytes(plan))
    part = read_plan_ops(path, plan.operations[0].src)
    assert part.operations and all(type(op) is Operation for op in part.operations)
    for op in part.operations:
        again = Operation.model_validate({field: getattr(op, field) for field in Operation.model_fields})  # every field, as a row has
        assert op == again and op.model_fields_set == again.model_fields_set and op.model_dump_json() == again.model_dump_json()
    constraints = {type(c).__name__ for field in Operation.model_fields.values() for c in field.metadata}
    assert constraints == {"Strict", "Ge"}  # what `plan_io._valid_as_read` checks besides the kind


@pytest.mark.parametrize("column, value", [("operations.chunks", 0), ("operations.kind.names", '["teleport"]'),
                                           ("operations.id", 1.5), ("operations.tensor", -1), ("operations.kind", -1),
                                           ("operations.kind", 0.0), ("operations.region", 0.0)])
def test_a_rank_refuses_a_row_its_record_would_refuse(tmp_path, column, value):
    """A column no record takes (a kind outside the table or at string -1 or 0.0, chunks 0, a float id or box
    index, tensor -1) is refused by a rank's read in one line naming the field, as validating each row refuses it."""
    plan = read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json")  # every operation names its tensor
    arrays = compact_arrays(plan)
    if isinstance(value, str):
        arrays[column] = np.frombuffer(value.encode(), dtype=np.uint8)
    else:
        arrays[column] = np.full(arrays[column].shape, value, dtype=np.float64 if isinstance(value, float) else np.int64)
    path = tmp_path / "bad.plan.npz"
    path.write_bytes(archive_bytes(arrays))
    field = column.split(".")[1]
    with pytest.raises(PlanFileError) as err:
        read_plan_ops(path, plan.operations[0].src)
    assert "\n" not in str(err.value) and field in str(err.value), str(err.value)


def test_index_steps_of_255_rows_or_more_come_back_through_the_wide_member(tmp_path):
    """`index.rows` is uint8: a device whose operations lie 255 or more rows apart has those steps in
    `index.rows.wide`, and reads its rows back exactly (device 7 at rows 0, 300 and 999 of 1,000)."""
    from xmesh_plan.schemas.plan_compact import WIDE_STEP, _device_index, _Members, device_rows

    count = 1000
    src = np.where(np.isin(np.arange(count), [0, 300, 999]), 7, 1)
    dsts = np.where(np.arange(count) == 600, 8, 2)
    none = np.zeros(0, dtype=np.int8)
    columns = {"operations.src": src, "operations.dsts.lengths": np.ones(count, np.int8), "operations.dsts.values": dsts,
               "operations.holders.lengths": np.zeros(count, np.int8), "operations.holders.values": none,
               "operations.needers.lengths": np.zeros(count, np.int8), "operations.needers.inner": none,
               "operations.needers.values": none, "operations.layout": np.arange(count)}
    index = _device_index(columns, count)  # every row its own layout
    assert index["index.rows"].dtype == np.uint8 and index["index.rows.wide"].tolist() == [300, 699]
    assert (index["index.rows"] == WIDE_STEP).sum() == 2
    path = tmp_path / "index.npz"
    path.write_bytes(archive_bytes({"header": np.frombuffer(b"{}", np.uint8), **index}))
    members = _Members(path)
    assert device_rows(members, 7).tolist() == [0, 300, 999]
    assert device_rows(members, 8).tolist() == [600]
    assert device_rows(members, 1).tolist() == [r for r in range(count) if r not in (0, 300, 999)]
    assert device_rows(members, 2).tolist() == [r for r in range(count) if r != 600]


def test_optional_integers_store_only_the_rows_that_have_one(tmp_path):
    """`carrier` is None on most operations: the column holds the others' values, the `.none` mask says which."""
    plan = read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json")
    carriers = [op.carrier for op in plan.operations]
    assert None in carriers and any(c is not None for c in carriers)
    arrays = compact_arrays(plan)
    assert arrays["operations.carrier"].tolist() == [c for c in carriers if c is not None]
    assert arrays["operations.carrier.none"].tolist() == [c is None for c in carriers]
    _round_trip(plan, tmp_path)


def test_another_format_version_is_refused_naming_both(tmp_path):
    import json

    from xmesh_plan.schemas.plan_compact import FORMAT_VERSION

    arrays = compact_arrays(read_plan_file(ROOT / "plans" / "case3.plan.json"))
    header = json.loads(bytes(arrays["header"]).decode())
    header["format_version"] = FORMAT_VERSION - 1
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    path = tmp_path / "old.plan.npz"
    path.write_bytes(archive_bytes(arrays))
    for read in (read_plan_file, lambda p: read_plan_ops(p, 0)):
        with pytest.raises(PlanFileError) as err:
            read(path)
        message = str(err.value)
        assert "\n" not in message and f"compact format version {FORMAT_VERSION - 1}; this reads version {FORMAT_VERSION}" in message


def _rank_reads_each_device(arrays: dict, tmp_path: Path) -> list[str]:
    """What each device's read of a compact file of `arrays` raises (PlanFileError), one message per device."""
    path = tmp_path / "bad.plan.npz"
    path.write_bytes(archive_bytes(arrays))
    messages = []
    for device in sorted({d for op in read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json").operations
                          for d in _devices(op)}):
        with pytest.raises(PlanFileError) as err:
            read_plan_ops(path, device)
        messages.append(str(err.value))
    return messages


def test_a_rank_refuses_a_string_table_of_other_than_strings(tmp_path):
    """`operations.kind.names` holding lists, not strings: a rank's read refuses it in one line naming the member, as
    `verify` does (the kind is then no string a record takes)."""
    import json

    arrays = compact_arrays(read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json"))
    names = json.loads(bytes(arrays["operations.kind.names"]).decode())
    arrays["operations.kind.names"] = np.frombuffer(json.dumps([[n] for n in names]).encode(), dtype=np.uint8)
    for message in _rank_reads_each_device(arrays, tmp_path):
        assert "\n" not in message and "operations.kind.names" in message, message


def test_an_optional_column_whose_mask_disagrees_with_its_values_is_refused_by_every_rank(tmp_path):
    """One `operations.carrier.none` flag flipped (one row more claims a carrier than are stored): every device refuses
    the file in one line naming the column, where some read every later carrier shifted by one row."""
    arrays = compact_arrays(read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json"))
    none = arrays["operations.carrier.none"].copy()
    none[int(np.flatnonzero(none)[0])] = False
    arrays["operations.carrier.none"] = none
    for message in _rank_reads_each_device(arrays, tmp_path):
        assert "\n" not in message and "operations.carrier" in message, message


@pytest.mark.parametrize("column", ["operations.src", "operations.dsts.values", "operations.chunks"])
def test_integers_beyond_int64_are_refused_naming_the_member(tmp_path, column):
    """An integer column stored as uint64 with values of 2**63 or more (no 64-bit signed integer holds them): a rank's
    read and `verify` refuse it in one line naming the member, where both crashed with OverflowError."""
    arrays = compact_arrays(read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json"))
    arrays[column] = np.full(arrays[column].shape, 2**63 + 1, dtype=np.uint64)
    for message in _rank_reads_each_device(arrays, tmp_path):
        assert "\n" not in message and f"{column}.npy" in message, message
    assert_user_error(run_cli("verify", tmp_path / "bad.plan.npz"), f"{column}.npy")


def _wide_float(arrays: dict) -> None:
    arrays["index.rows"][3] = 255
    arrays["index.rows.wide"] = np.array([7.5])


def _wide_extra(arrays: dict) -> None:
    arrays["index.rows.wide"] = np.array([7, 9], dtype=np.int64)


def _wide_narrow(arrays: dict) -> None:
    arrays["index.rows.wide"] = np.array([int(arrays["index.rows"][3])], dtype=np.int64)
    arrays["index.rows"][3] = 255


@pytest.mark.parametrize("change", [_wide_float, _wide_extra, _wide_narrow])
def test_a_wide_index_member_other_than_the_writer_s_is_refused(tmp_path, change):
    """`index.rows.wide` holding a float (7.5 read as 7), more entries than `index.rows` has 255 markers, or a step
    under 255: every device refuses the file in one line naming the member."""
    arrays = compact_arrays(read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json"))
    arrays["index.rows"] = arrays["index.rows"].copy()
    assert not (arrays["index.rows"] == 255).any() and len(arrays["index.rows.wide"]) == 0
    change(arrays)
    for message in _rank_reads_each_device(arrays, tmp_path):
        assert "\n" not in message and "index.rows.wide" in message, message


def test_compile_verifies_the_one_file_it_writes_in_the_output_s_folder(tmp_path, monkeypatch):
    """`compile -o x.plan.npz` writes the bytes once: `verify` proves the temporary file in the output's folder that
    is then renamed over the output (no private copy elsewhere); a plan that fails leaves the old file and no
    temporary file."""
    from xmesh_plan.planner import cli

    verified = []
    real = cli.verify_plan_file

    def spy(path, **kwargs):
        verified.append((Path(path).parent, Path(path).read_bytes()))
        return real(path, **kwargs)

    monkeypatch.setattr(cli, "verify_plan_file", spy)
    target = tmp_path / "ws.plan.npz"
    assert run_cli("compile", ROOT / "plans" / "weight_sync_small.problem.toml", "-o", target).exit_code == 0
    assert verified == [(tmp_path, target.read_bytes())]
    assert [p.name for p in tmp_path.iterdir()] == ["ws.plan.npz"]

    def refuse(path, **kwargs):
        raise cli.PlanError("operation 3 receives [0:4] twice")

    monkeypatch.setattr(cli, "verify_plan_file", refuse)
    target.write_bytes(b"old plan")
    assert isinstance(run_cli("compile", ROOT / "plans" / "weight_sync_small.problem.toml", "-o", target).exception, cli.PlanError)
    assert [p.name for p in tmp_path.iterdir()] == ["ws.plan.npz"] and target.read_bytes() == b"old plan"


def test_a_full_disk_while_writing_a_compact_plan_names_the_output(tmp_path, monkeypatch):
    """A write that fails for want of space (an OSError naming no file, as a descriptor's write raises) is the
    last-resort handler's one line naming the output, not "standard output" (what the failure of the private copy
    `compile` verified said), and leaves no file."""
    import errno
    import pathlib

    from xmesh_plan.schemas import files
    from xmesh_plan.schemas.last_resort import environment_error_line

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_bytes", full)
    monkeypatch.setattr(files, "_write_closed", full, raising=False)
    target = tmp_path / "ws.plan.npz"
    result = run_cli("compile", ROOT / "plans" / "weight_sync_small.problem.toml", "-o", target)
    assert isinstance(result.exception, OSError) and result.exception.errno == errno.ENOSPC, result.output
    line = environment_error_line(result.exception)
    assert str(target) in line and "standard output" not in line, line
    assert list(tmp_path.iterdir()) == []


def test_repeated_layers_store_each_layout_once():
    """The Llama-3-8B-like weight sync (its 32 layers alike): each distinct (kind, devices, boxes, bundle) of the
    operations and (box, devices, strategy, ...) of the tasks is stored once, every row naming its layout; a plan
    with no repeated layout leaves `<table>.layout` out."""
    from xmesh_plan.schemas.plan_compact import LAYOUTS

    plan = read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json")
    arrays = compact_arrays(plan)
    for table in ("operations", "tasks"):
        rows = getattr(plan, table)
        distinct = {tuple(getattr(r, f) for f in LAYOUTS[table]) for r in rows}
        assert len(arrays[f"{table}.layout"]) == len(rows) > len(distinct) == len(arrays[f"{table}.{LAYOUTS[table][0]}"])
    assert len(arrays["operations.id"]) == len(plan.operations)  # ids, tensors, times: per row
    single = compact_arrays(read_plan_file(ROOT / "plans" / "case1.plan.json"))
    assert "operations.layout" not in single and "tasks.layout" not in single


def test_only_members_no_rank_reads_are_deflated(tmp_path, monkeypatch):
    """Tasks and host order are deflated (read whole by `verify`, never by a rank); a rank's read inflates nothing."""
    from xmesh_plan.schemas.plan_compact import _Members

    plan = read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json")
    path = tmp_path / "x.plan.npz"
    path.write_bytes(compact_bytes(plan))
    with zipfile.ZipFile(path) as archive:
        deflated = {i.filename for i in archive.infolist() if i.compress_type == zipfile.ZIP_DEFLATED}
    assert deflated and all(name.startswith(("tasks.", "host_order.")) for name in deflated)
    assert "tasks.id.npy" in deflated and "operations.id.npy" not in deflated
    monkeypatch.setattr(_Members, "_inflate", lambda self, name: pytest.fail(f"a rank inflated {name}"))
    for device in sorted({d for op in plan.operations for d in _devices(op)}):
        assert read_plan_ops(path, device).operations == tuple(op for op in plan.operations if device in _devices(op))


def _damaged_deflate(path: Path, member: str) -> None:
    """Flip a byte in the middle of `member`'s deflated data."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(member)
    data = bytearray(path.read_bytes())
    local = info.header_offset
    start = local + 30 + int.from_bytes(data[local + 26:local + 28], "little") + int.from_bytes(data[local + 28:local + 30], "little")
    data[start + info.compress_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_deflated_member_is_refused_naming_it(tmp_path):
    """A bit flipped in the deflated tasks: the whole-file read and `verify` refuse it in one line naming the member."""
    plan = read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json")
    path = tmp_path / "bad.plan.npz"
    path.write_bytes(compact_bytes(plan))
    _damaged_deflate(path, "tasks.senders.values.npy")
    with pytest.raises(PlanFileError) as err:
        read_plan_file(path)
    assert "\n" not in str(err.value) and "tasks.senders.values.npy" in str(err.value), str(err.value)
    assert_user_error(run_cli("verify", path), "tasks.senders.values.npy")


def test_a_member_compressed_another_way_is_refused_naming_it(tmp_path):
    arrays = compact_arrays(read_plan_file(ROOT / "plans" / "case3.plan.json"))
    path = tmp_path / "bz.plan.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_BZIP2) as archive:
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w") as member:
                np.lib.format.write_array(member, array, allow_pickle=False)
    for read in (read_plan_file, lambda p: read_plan_ops(p, 0)):
        with pytest.raises(PlanFileError) as err:
            read(path)
        assert "\n" not in str(err.value) and "header.npy is compressed by method 12" in str(err.value), str(err.value)


def _layout_out_of_range(arrays: dict) -> None:
    layout = arrays["operations.layout"].copy()
    layout[5] = len(arrays["operations.kind"])
    arrays["operations.layout"] = layout


def _layout_as_floats(arrays: dict) -> None:
    arrays["operations.layout"] = arrays["operations.layout"].astype(np.float64)


def _layout_missing(arrays: dict) -> None:
    del arrays["operations.layout"]


@pytest.mark.parametrize("change", [_layout_out_of_range, _layout_as_floats, _layout_missing])
def test_an_odd_layout_member_is_refused_naming_it(tmp_path, change):
    """`operations.layout` naming a layout the columns lack (at row 5), holding floats, or left out where the layouts
    are fewer than the rows: each device reading a row it spoils, the whole-file read and `verify` refuse the file in
    one line naming the member."""
    plan = read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json")
    arrays = compact_arrays(plan)
    change(arrays)
    path = tmp_path / "bad.plan.npz"
    path.write_bytes(archive_bytes(arrays))
    readers = _devices(plan.operations[5]) if change is _layout_out_of_range else {d for op in plan.operations for d in _devices(op)}
    for read in [read_plan_file, *(lambda p, d=d: read_plan_ops(p, d) for d in sorted(readers))]:
        with pytest.raises(PlanFileError) as err:
            read(path)
        assert "\n" not in str(err.value) and "operations.layout" in str(err.value), str(err.value)
    assert_user_error(run_cli("verify", path), "operations.layout")


def test_compile_to_a_device_verifies_a_private_copy_of_the_bytes_it_writes(monkeypatch):
    """`-o /dev/null --format compact`: no temporary file can sit beside a device, so `verify` proves a private copy
    of the very bytes written through."""
    from xmesh_plan.planner import cli

    verified = []
    real = cli.verify_plan_file

    def spy(path, **kwargs):
        verified.append(Path(path).read_bytes())
        return real(path, **kwargs)

    monkeypatch.setattr(cli, "verify_plan_file", spy)
    result = run_cli("compile", ROOT / "plans" / "weight_sync_small.problem.toml", "--format", "compact", "-o", "/dev/null")
    assert result.exit_code == 0, result.output
    assert len(verified) == 1 and verified[0] == compact_bytes(read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json"))


def test_repeated_layouts_read_back_as_one_object_each(tmp_path, monkeypatch):
    """A whole compact plan read back gives the operations of a model's repeated layers the same box and device
    objects (one per distinct value, also across the chunks the reader decodes at a time), so that what `inspect`
    and the staging model compute per distinct operation is computed once; the plan is the one written."""
    from xmesh_plan.schemas import plan_compact

    plan = read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json")
    monkeypatch.setattr(plan_compact, "CHUNK_ROWS", 7)  # many chunks
    back = _round_trip(plan, tmp_path)
    for table, fields in (("operations", ("dsts", "region", "parts", "holders", "needers")),
                          ("tasks", ("region", "senders", "receivers", "receiver_hosts"))):
        for field in fields:
            values = [getattr(row, field) for row in getattr(back, table)]
            assert len({id(v) for v in values}) == len(set(values)) < len(values), (table, field)
    for task in back.tasks:  # records as validation makes them, with the same fields set
        again = UnitTask.model_validate({field: getattr(task, field) for field in UnitTask.model_fields})
        assert task == again and task.model_fields_set == again.model_fields_set
    constraints = {type(c).__name__ for field in UnitTask.model_fields.values() for c in field.metadata}
    assert constraints == {"Strict", "Ge"}  # what `plan_io._tasks` checks besides the strategy


def test_a_task_of_an_unknown_strategy_is_refused_naming_it(tmp_path):
    """A task table whose strategy names no strategy is refused by the whole plan's read, naming the field."""
    plan = read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json")
    arrays = compact_arrays(plan)
    arrays["tasks.strategy.names"] = np.frombuffer(b'["teleport"]', dtype=np.uint8)
    path = tmp_path / "bad.plan.npz"
    path.write_bytes(archive_bytes(arrays))
    with pytest.raises(PlanFileError) as err:
        read_plan_file(path)
    assert "\n" not in str(err.value) and "strategy" in str(err.value), str(err.value)



_HOSTILE_CHECK = """
import sys
from tests.support.cli import assert_user_error, run_cli
from xmesh_plan.executor.plan_file import PlanFile
from xmesh_plan.schemas import PlanFileError, read_plan_file

path, word, refused = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
for how, read in (("read", read_plan_file), ("rank", lambda p: [PlanFile.read(p).device_ops(d) for d in range(64)])):
    try:
        read(path)
        assert how not in refused, f"{how} took the file"
    except PlanFileError as err:
        assert "\\n" not in str(err) and word in str(err) and "damaged" in str(err), str(err)
for command in ("verify", "inspect"):
    assert_user_error(run_cli(command, path), word)
"""


def _hostile_files(tmp_path: Path) -> dict[str, tuple[Path, str, str]]:
    """Compact files whose lengths or indices are far outside what their members hold: (file, what the error names,
    the reads that refuse it: "read", the whole plan's, and "rank", a rank's, where it reads the member at fault)."""
    small = compact_arrays(read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json"))
    chunked = compact_arrays(read_plan_file(ROOT / "plans" / "case4.plan.json"))
    dsts = small["operations.dsts.lengths"].astype(np.int64)
    huge, short = dsts.copy(), dsts.copy()
    huge[9] = 2**31  # would allocate 16 GiB of positions
    short[np.flatnonzero(short)[0]] -= 1  # every length in range, one value left over
    full = lambda arrays, member, value: np.full(arrays[member].shape, value, np.int64)
    cases = {
        "dims-wrap": (small, "boxes.dims", full(small, "boxes.dims", 2**62), "read,rank"),  # the running sum wraps
        "length-huge": (small, "operations.dsts.lengths", huge, "read,rank"),
        "length-max": (small, "tasks.senders.lengths", full(small, "tasks.senders.lengths", 2**63 - 1), "read"),
        "length-short": (small, "operations.dsts.lengths", short, "read,rank"),
        "chunks-huge": (chunked, "operations.chunks", full(chunked, "operations.chunks", 2**62), "read"),  # tags pass 2**63
        "tensor-max": (small, "operations.tensor", full(small, "operations.tensor", 2**63 - 1), "read"),
        "tensor-huge": (small, "operations.tensor", full(small, "operations.tensor", 2**40), "read"),
    }
    out = {}
    for name, (arrays, member, values, refused) in cases.items():
        out[name] = (tmp_path / f"{len(out)}.plan.npz", f"{member}.npy", refused)
        out[name][0].write_bytes(archive_bytes({**arrays, member: values}))
    return out


def test_lengths_and_indices_beyond_their_members_are_refused_in_one_line(tmp_path):
    """A compact file whose lengths exceed, or do not add up to, the values they cut, or whose chunks or tensor
    indices are beyond any plan's, is refused in one line naming the member (or field) by `verify` and `inspect`,
    and by the reads that read it: each in a process of at most 4 GiB of address space, so that a crash or an
    unbounded allocation fails the test and spares the machine."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))

    failed = {}
    for name, (path, word, refused) in _hostile_files(tmp_path).items():
        done = subprocess.run([sys.executable, "-c", _HOSTILE_CHECK, str(path), word, refused], cwd=ROOT,
                              preexec_fn=limit, capture_output=True, text=True, timeout=300)
        if done.returncode:
            failed[name] = (done.returncode, done.stderr.strip().splitlines()[-1:])
    assert not failed, failed


def test_tags_are_numbered_per_tensor_named():
    """Tags count tensor by tensor in index order, each operation a block in plan order; a tensor index far above
    the others is numbered as the next one would be."""
    assert number_tags([2, 3, 1, 4], [2**62, 0, 2**62, 1]) == ([7, 0, 9, 3], 10)
    assert number_tags([2, 3, 1, 4], [2, 0, 2, 1]) == ([7, 0, 9, 3], 10)
    assert number_tags([], []) == ([], 0)
