"""Logical axis names carried by flax parameters in a step's arguments, as Hints entries:
linen's `nn.with_partitioning` / `nn.with_logical_partitioning` boxes (`nn.Partitioned`,
`nn.LogicallyPartitioned`) and nnx Variables made with `nnx.with_partitioning`. The matching
and the rules are shardplan.intra.hints'.

flax's classes are read from `sys.modules`: a box can only be in the arguments when the user
imported flax, and a step without flax does not pay for importing it (about a second)."""

from __future__ import annotations

import sys

import jax

from shardplan.options import Hints, path_str

# nnx Variable metadata holding the names of a value's dimensions, newest first
_NNX_KEYS = ("out_sharding", "sharding_names", "sharding")


def _classes() -> tuple[type, ...]:
    meta, nnx = sys.modules.get("flax.core.meta"), sys.modules.get("flax.nnx")
    return ((meta.Partitioned,) if meta else ()) + ((nnx.Variable,) if nnx else ())


def _names(box) -> tuple | None:
    names = getattr(box, "names", None)
    if names is None and hasattr(box, "get_metadata"):
        metadata = box.get_metadata()
        names = next((metadata[k] for k in _NNX_KEYS if metadata.get(k)), None)
    return None if names is None else tuple(names)


def box_names(args) -> tuple[tuple[str, tuple], ...]:
    """(path, names) of every flax box in `args` (the step's positional arguments) whose value
    carries axis names; paths as the trace's (argument index first)."""
    classes = _classes()
    if not classes:
        return ()
    leaves = jax.tree_util.tree_flatten_with_path(
        tuple(args), is_leaf=lambda x: isinstance(x, classes))[0]
    out = []
    for path, leaf in leaves:
        names = _names(leaf) if isinstance(leaf, classes) else None
        if names:
            out.append((path_str(path), names))
    return tuple(out)


def check_mesh_axes(hints: Hints, axis_names) -> None:
    """A ValueError naming each logical axis rule whose mesh axes the mesh does not have: a
    typo (`("batch", "dta")`) would otherwise leave the rule unused without a word
    (tests/test_hardening.py::test_a_rule_naming_no_mesh_axis_is_an_error)."""
    names = tuple(axis_names)
    bad = [(name, axes) for name, axes in hints.logical_axis_rules
           if any(a not in names for a in ((axes,) if isinstance(axes, str) else axes or ()))]
    if bad:
        shown = ", ".join(f"({name!r}, {axes!r})" for name, axes in bad)
        raise ValueError(f"logical_axis_rules {shown} name mesh axes the mesh does not have; "
                         f"its axes are {', '.join(map(repr, names))} (None keeps a logical "
                         "axis unsharded)")


def with_boxes(hints: Hints, args, model_constraints: str = "hint") -> Hints:
    """`hints` with the names the flax boxes in `args` carry (unchanged when none do, or when
    the model's own annotations are ignored: SearchOptions.model_constraints="ignore";
    tests/test_model_constraints.py::test_the_option_is_checked_and_box_names_follow_it)."""
    if model_constraints == "ignore":
        return hints
    found = box_names(args)
    return hints.with_logical_names(found) if found else hints
