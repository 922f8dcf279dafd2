"""Sharding spec parsing: every accepted notation, exact round-trip, errors that name the bad token."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xmesh_plan.schemas.spec import DimSharding, ShardingSpec, SpecError

S0RR = ShardingSpec((DimSharding((0,)), DimSharding(()), DimSharding(())))


@pytest.mark.parametrize("text", ["S0RR", "S0 R R", "S^0 R R", "S^0RR", "S0,R,R", "S0, R, R", "  S0  R  R  ", "S0\tR\tR"])
def test_notations_of_s0rr_all_parse_to_the_same_spec(text):
    assert ShardingSpec.parse(text) == S0RR


@pytest.mark.parametrize("text, axes", [
    ("R S01 R", ((), (0, 1), ())),
    ("RS01R", ((), (0, 1), ())),
    ("R S^01 R", ((), (0, 1), ())),
    ("R S^{01} R", ((), (0, 1), ())),
    ("S1,R,R", ((1,), (), ())),
    ("S10 R", ((1, 0), ())),
    ("R", ((),)),
    ("S2 S0 S1", ((2,), (0,), (1,))),
])
def test_parse_gives_the_mesh_axes_major_first(text, axes):
    spec = ShardingSpec.parse(text)
    assert tuple(d.mesh_axes for d in spec.dims) == axes


def test_str_is_space_separated_canonical_form():
    assert str(ShardingSpec.parse("S^0,R,R")) == "S0 R R"
    assert str(ShardingSpec.parse("RS01R")) == "R S01 R"


def test_repr_pastes_back_as_code():
    spec = ShardingSpec.parse("R S01 R")
    assert eval(repr(spec), {"ShardingSpec": ShardingSpec}) == spec


def test_specs_are_frozen_and_hashable():
    a, b = ShardingSpec.parse("S0RR"), ShardingSpec.parse("S0 R R")
    assert hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(Exception):
        a.dims = ()  # type: ignore[misc]


def test_dim_predicates():
    assert DimSharding(()).is_replicated and str(DimSharding(())) == "R"
    assert not DimSharding((0, 1)).is_replicated and str(DimSharding((0, 1))) == "S01"


@pytest.mark.parametrize("text, token", [
    ("S0 X R", "X"),
    ("R Q", "Q"),
    ("S0 R R x", "x"),
    ("r", "r"),
    ("S", "S"),
    ("S0 S R", "S"),
    ("R,,R", ",R"),
])
def test_bad_token_error_names_the_token_and_shows_an_example(text, token):
    with pytest.raises(SpecError) as err:
        ShardingSpec.parse(text)
    message = str(err.value)
    assert f"bad token {token!r}" in message
    assert text in message
    assert "S0 R R" in message  # a valid example


@pytest.mark.parametrize("text", ["", "   "])
def test_empty_spec_is_rejected_with_an_example(text):
    with pytest.raises(SpecError, match="empty sharding spec.*S0 R R"):
        ShardingSpec.parse(text)


def test_non_string_is_rejected():
    with pytest.raises(SpecError):
        ShardingSpec.parse(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("text, axis", [("S0 S0 R", 0), ("S00", 0), ("S01 S1", 1), ("R S12 S2", 2)])
def test_a_mesh_axis_used_twice_is_rejected_naming_the_axis(text, axis):
    with pytest.raises(SpecError, match=f"mesh axis {axis} is used more than once"):
        ShardingSpec.parse(text)


def test_spec_error_is_a_value_error():
    assert issubclass(SpecError, ValueError)


@pytest.mark.parametrize("text", ["S0}R", "S{0 R"])
def test_unbalanced_braces_are_rejected(text):
    with pytest.raises(SpecError):
        ShardingSpec.parse(text)


# --- check_fits: rank and mesh axes ---------------------------------------------------------------

def test_check_fits_accepts_a_matching_spec():
    ShardingSpec.parse("R S01 R").check_fits(3, (2, 4))


@pytest.mark.parametrize("text, rank", [("S0 R", 3), ("S0 R R R", 3)])
def test_check_fits_rejects_wrong_rank_naming_field_and_counts(text, rank):
    with pytest.raises(SpecError) as err:
        ShardingSpec.parse(text).check_fits(rank, (2, 4), field="dst.spec")
    message = str(err.value)
    assert message.startswith("dst.spec")
    assert f"has {len(text.split())} entries" in message and f"{rank} dims" in message


def test_check_fits_rejects_a_nonexistent_mesh_axis():
    with pytest.raises(SpecError) as err:
        ShardingSpec.parse("S2 R R").check_fits(3, (2, 4), field="src.spec")
    message = str(err.value)
    assert "src.spec" in message and "mesh axis 2" in message and "2x4" in message and "0..1" in message


@pytest.mark.parametrize("text, mesh, counts", [
    ("R S01 R", (2, 4), (1, 8, 1)),
    ("S10 R", (2, 4), (8, 1)),
    ("S1 S0", (3, 5), (5, 3)),
    ("R R", (2, 4), (1, 1)),
    ("S012", (2, 3, 5), (30,)),
])
def test_shard_counts(text, mesh, counts):
    assert ShardingSpec.parse(text).shard_counts(mesh) == counts


# --- round-trip property ----------------------------------------------------------------------------

@st.composite
def specs(draw, max_axes: int = 10, max_rank: int = 5):
    """A valid spec: each mesh axis (0..9, one digit) sharding at most one dim, in any order."""
    rank = draw(st.integers(1, max_rank))
    axes = draw(st.permutations(range(max_axes)))
    used = axes[: draw(st.integers(0, max_axes))]
    owner = [draw(st.integers(0, rank - 1)) for _ in used]
    dims = [tuple(a for a, o in zip(used, owner) if o == d) for d in range(rank)]
    return ShardingSpec(tuple(DimSharding(d) for d in dims))


@settings(max_examples=200, deadline=None)
@given(specs())
def test_parse_of_str_is_identity(spec):
    assert ShardingSpec.parse(str(spec)) == spec


@settings(max_examples=100, deadline=None)
@given(specs(), st.sampled_from([" ", ",", ", ", ""]), st.booleans())
def test_other_separators_and_caret_parse_the_same(spec, sep, caret):
    text = sep.join(("S^" + str(d)[1:]) if caret and not d.is_replicated else str(d) for d in spec.dims)
    assert ShardingSpec.parse(text) == spec
