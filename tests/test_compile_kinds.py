"""A transfer's tensors of one kind (shape, element size, placements) are cut and costed once: the plan is the one
planned tensor by tensor, byte for byte."""

import tomllib

from xmesh_plan.planner import compile as compiler
from xmesh_plan.planner.transfer_io import build_transfer
from xmesh_plan.planner.weight_sync import WEIGHT_SYNC, Layout, weight_sync_toml


def _small(**layout) -> object:
    name, model, base = WEIGHT_SYNC["weight_sync_small"]
    return build_transfer(tomllib.loads(weight_sync_toml(name, model, Layout(**{**base.__dict__, **layout}))))


def test_tensors_of_one_kind_share_their_planning_and_the_plan_is_the_one_planned_tensor_by_tensor(monkeypatch):
    for problem in (_small(), _small(nics=2, devices_per_host=2)):
        kinds = compiler._kinds(problem.tensor_problems())
        assert len(set(kinds)) < len(kinds)  # the layers repeat: fewer kinds than tensors
        shared = compiler.compile_plan(problem)
        monkeypatch.setattr(compiler, "_kinds", lambda singles: list(range(len(singles))))  # every tensor its own kind
        alone = compiler.compile_plan(problem)
        monkeypatch.undo()
        assert shared.to_json() == alone.to_json()


def test_kinds_tell_apart_what_changes_the_cut():
    p = build_transfer({"src_mesh": "1x4", "dst_mesh": "1x2", "dtype": "bfloat16", "tensors": [
        {"name": "a", "shape": [8, 8], "src": "S1 R", "dst": "R S1"}, {"name": "b", "shape": [8, 8], "src": "S1 R", "dst": "R S1"},
        {"name": "c", "shape": [8, 4], "src": "S1 R", "dst": "R S1"}, {"name": "d", "shape": [8, 8], "src": "S1 R", "dst": "S1 R"},
        {"name": "e", "shape": [8, 8], "dtype": "float32", "src": "S1 R", "dst": "R S1"}]})
    kinds = compiler._kinds(p.tensor_problems())
    assert kinds[0] == kinds[1] and len(set(kinds)) == 4



def test_the_bound_sums_a_kinds_cells_once_and_counts_them_as_often_as_the_kind_repeats():
    """`joint_lower_bound` given one list of cells for several tensors (a compile's tensors of one kind) is the bound of
    as many copies of it, to the bit and with the same reason."""
    from xmesh_plan.planner.bounds import joint_lower_bound
    from xmesh_plan.planner.unit_tasks import decompose

    problem = _small(nics=2, devices_per_host=2)
    singles = problem.tensor_problems()
    cells = [decompose(s, max_tasks=None) for s in singles]
    shared = [(cells[0], singles[0].itemsize)] * 3 + [(c, s.itemsize) for c, s in zip(cells[1:], singles[1:])]
    copies = [(list(cells[0]), singles[0].itemsize) for _ in range(3)] + [(list(c), s.itemsize) for c, s in zip(cells[1:], singles[1:])]
    assert joint_lower_bound(shared, problem.cluster) == joint_lower_bound(copies, problem.cluster)
    assert joint_lower_bound(shared, problem.cluster) != joint_lower_bound(shared[2:], problem.cluster)
