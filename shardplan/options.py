"""SearchOptions: every option of a search, with its default, in one frozen value.

api.auto / cluster.search, the CLI and the YAML config build one and pass it down; the planners
read it (shardplan.search turns it into the intra-op planner's IntraOptions).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from shardplan.units import parse_bytes

SCHEDULES = ("1f1b", "gpipe")
"""Pipeline schedules: 1F1B (PipeDream-flush) and GPipe."""
PIPELINE_MODES = ("auto", True, False, "spmd", "mpmd")
MODEL_CONSTRAINTS = ("hint", "ignore")
"""What the planner does with the model's own sharding constraints (SearchOptions.model_constraints)."""

BACKWARD_PER_FORWARD = 2.0
"""A micro-batch's backward takes about twice its forward: a stage's time per micro-batch is
split 1 : 2 between them (schedule simulation, pipeline plans, timelines)."""


def check_schedule(schedule: str) -> str:
    """`schedule` if it is one of SCHEDULES, else the error that lists them."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {SCHEDULES}")
    return schedule


def path_str(keypath) -> str:
    """The '/'-joined path of a pytree leaf (`0/params/Dense_0/kernel`) from its jax key path.
    A trailing `value` attribute (the array inside a flax metadata box or nnx Variable) is
    dropped, so a parameter has the same path boxed or not."""
    parts = []
    for k in keypath:
        for attr in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    if parts and parts[-1] == "value" and isinstance(keypath[-1], jax.tree_util.GetAttrKey):
        parts.pop()
    return "/".join(parts)


def path_matches(pattern: str, path: str) -> bool:
    """Whether the '/'-joined `path` matches the hint pattern `pattern` (Hints.pins): `**` is
    any number of components (none too), any other component an fnmatch pattern of one.

    Wildcard matching with one backtracking point (the last `**` seen): at most
    len(components of pattern) x len(components of path) component matches, however many
    `**` the pattern holds (tests/test_hardening.py::test_double_star_patterns_match_in_
    polynomial_time; the same answers as the recursive definition on random cases there)."""
    pat, parts = pattern.strip("/").split("/"), path.split("/")
    i = j = 0
    star, mark = -1, 0
    while j < len(parts):
        if i < len(pat) and pat[i] == "**":
            star, mark = i, j
            i += 1
        elif i < len(pat) and fnmatch.fnmatchcase(parts[j], pat[i]):
            i, j = i + 1, j + 1
        elif star >= 0:  # let the last `**` take one more component, retry after it
            mark += 1
            i, j = star + 1, mark
        else:
            return False
    return all(p == "**" for p in pat[i:])


def partition_spec(spec) -> PartitionSpec:
    """A PartitionSpec from a loose user value: a PartitionSpec, a sequence of entries (None,
    an axis name, or a sequence of axis names) as YAML gives it, or None (replicated)."""
    if spec is None:
        return PartitionSpec()
    if isinstance(spec, PartitionSpec):
        return spec
    if isinstance(spec, str) or not isinstance(spec, Sequence):
        raise TypeError(f"{spec!r} is no PartitionSpec: give PartitionSpec(...) or a list of "
                         "axis names, None or lists of axis names, one per dimension")
    return PartitionSpec(*(e if e is None or isinstance(e, str) else tuple(e) for e in spec))


def _axes(entry) -> str | tuple[str, ...] | None:
    return entry if entry is None or isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class Hints:
    """Shardings the user fixes; the planner chooses the rest (shardplan.intra.hints).

    `Hints({"0/params/**/kernel": P(None, "model"), "2/**": P("data")},
    logical_axis_rules=[("batch", "data"), ("mlp", "model"), ("embed", None)],
    logical_specs=nn.get_partition_spec(variables))`. A dict or a list of (pattern, spec)
    pairs given as `hints=` is the `pins` of a Hints; lists and dicts are normalised to
    tuples, so Hints (and SearchOptions) stay hashable."""

    pins: tuple[tuple[str, PartitionSpec], ...] = ()
    """(pattern, PartitionSpec) pairs, first match wins. A pattern is matched against the
    '/'-joined path of each flat input, argument index first (`0/params/Dense_0/kernel`,
    `2/input_ids`): `*` is one component (or part of one: `Dense_*`), `**` any number."""
    logical_axis_rules: tuple[tuple[str, str | tuple[str, ...] | None], ...] = ()
    """(logical name, mesh axis, axes or None) pairs, as flax's `nn.logical_axis_rules`:
    each dimension takes the first rule of its name whose mesh axes are still free."""
    logical_names: tuple[tuple[str, tuple], ...] = ()
    """(path, logical names per dimension) of parameters that carry names: from
    `logical_specs`, and from flax boxes in the arguments (shardplan.hints). A path with an
    argument index is that input's; one without applies to every argument whose path equals
    or ends with it (optax's mu and nu mirror the parameters)."""
    logical_specs: dataclasses.InitVar[Any] = None
    """A pytree of PartitionSpecs of logical names shaped like a parameter argument
    (`nn.get_partition_spec(variables)`, `nnx.get_partition_spec(state)`)."""

    def __post_init__(self, logical_specs):
        pins = self.pins.items() if isinstance(self.pins, Mapping) else self.pins
        try:
            pins = tuple((str(pat), partition_spec(spec)) for pat, spec in pins)
        except (TypeError, ValueError) as e:
            raise ValueError(f"hints: give a dict or a list of (pattern, PartitionSpec) "
                             f"pairs: {e}") from None
        rules = tuple((str(name), _axes(axes)) for name, axes in self.logical_axis_rules)
        names = tuple((str(p), tuple(_axes(e) for e in n)) for p, n in self.logical_names)
        if logical_specs is not None:
            leaves = jax.tree_util.tree_flatten_with_path(
                logical_specs, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None)[0]
            # P() is what flax gives a parameter without names: left to the planner
            names += tuple((path_str(p), tuple(_axes(e) for e in s)) for p, s in leaves
                           if isinstance(s, PartitionSpec) and len(s))
        object.__setattr__(self, "pins", pins)
        object.__setattr__(self, "logical_axis_rules", rules)
        object.__setattr__(self, "logical_names", names)

    @classmethod
    def of(cls, hints) -> Hints:
        """Hints from what a user passes as `hints=`: None, a Hints, a dict or pairs."""
        if hints is None:
            return cls()
        return hints if isinstance(hints, Hints) else cls(hints)

    def __bool__(self) -> bool:
        return bool(self.pins or self.logical_names)

    def with_logical_names(self, names) -> Hints:
        """These hints with more (path, names) entries (from flax boxes in the arguments)."""
        return dataclasses.replace(self, logical_names=self.logical_names + tuple(names))


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """How to search a plan (everything but the step, the mesh and the hardware)."""

    memory_budget: int | None = None
    """Bytes per device (an int, or a string like "16GiB" given to `make`); None: no budget
    for the single-program planner, the profile's memory for the pipeline planner."""
    time_limit: float = 30.0
    """Seconds the ILP solver may take per solve (it returns its best plan so far)."""
    solver_seed: int = 0
    """The CP-SAT solver's random seed (plans are deterministic for a seed)."""
    workers: int = 1
    """Solver threads (1 keeps plans deterministic)."""
    deterministic: bool = False
    """Limit each solve by its work instead of the wall clock: time_limit becomes seconds of
    deterministic work per solve (CP-SAT's deterministic time; HiGHS's simplex iterations and
    branch-and-bound nodes at fixed rates, shardplan.intra.settings) and the intra-op planner
    keeps no deadline, so the plan is the same at any load, however long it takes (the tests
    plan so)."""
    state_argnums: tuple[int, ...] | None = None
    """Which arguments are state (params, optimizer state); default those an output gives back."""
    batch_argnums: tuple[int, ...] | None = None
    """Which arguments are the batch; default the arguments that are not state."""
    pipeline: bool | str = False
    """False (one program); True (pipeline stages: an SPMD pipeline, one program with a
    `stage` mesh axis, where the loss runs its layers as one scan over stacked parameters,
    else MPMD stages on submeshes, one program each); "spmd" or "mpmd" (that kind only);
    "auto" (MPMD stages where the cost model says they pay)."""
    num_micro_batches: int | None = None
    """Micro-batches per step of a pipeline; default the planner's choice."""
    num_stages: int | None = None
    """Force this many pipeline stages on equal submeshes; default the stage DP's choice."""
    num_layers: int | None = None
    """Layers the loss function is clustered into for the stage DP; default min(8, ...)."""
    schedule: str = "1f1b"
    """Pipeline schedule, one of SCHEDULES."""
    measure: bool = False
    """Also compile the searched plan and the expert plans with XLA, price each with the
    hardware profile and keep the cheapest that fits (shardplan.planning.select)."""
    while_trips: float = 1.0
    """Iterations a while loop JAX knows no trip count of is priced at (scan and fori_loop
    with static bounds have theirs); the plan's notes say when this was used."""
    hints: Hints = Hints()
    """Shardings to pin (a Hints, or a dict / list of (pattern, PartitionSpec) pairs): the
    planner keeps them and plans the rest. One program only (not with pipeline=True)."""
    remat: bool | str = "auto"
    """Rematerialize scanned layers (shardplan.ir.remat: the backward pass recomputes each
    layer of a `lax.scan` / `nn.scan` from its input instead of keeping its stacked
    activations): "auto" only where no plan of the step as written fits the memory budget
    and the rematerialized one does; True always; False never. One program only: pipelines
    (and shardplan.auto's choice with pipeline="auto") are planned as written."""
    grad_accumulation: int | str = "auto"
    """Run the step as M micro-batches (shardplan.inter.accumulate: the loss and gradient a
    scan over micro-batches whose gradients are summed, the update once; activations held for
    one micro-batch at a time): "auto" only where no plan of the step as written (or
    rematerialized, see `remat`) fits the memory budget, the fewest micro-batches that fit,
    for a loss that is a mean over the batch; an int M always (1: never). One program only."""
    model_constraints: str = "hint"
    """The model's own sharding constraints (`jax.lax.with_sharding_constraint`, flax's
    `nn.with_logical_constraint`, MaxText's and Gemma's): "hint" holds each value to the
    layout the model asks for (re-placed on the plan's mesh where the model was built for
    another, e.g. one device), priced by the planner; "ignore" lays those values out as the
    planner chooses. Neither binds a constraint as written; the plan's notes say what was
    done with each. shardplan.hints.with_boxes, given "ignore", also leaves unread the logical
    axis names the model's flax parameters carry."""

    def __post_init__(self):
        object.__setattr__(self, "hints", Hints.of(self.hints))
        # a budget given directly is checked as `make` checks it (10**400 is a ValueError)
        object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
        if self.hints and self.pipeline in (True, "spmd", "mpmd"):
            raise ValueError("hints pin the shardings of one program; pipeline stages do not "
                             "take them: pass pipeline=False (or 'auto', which then plans one "
                             "program)")
        if self.pipeline not in PIPELINE_MODES:
            raise ValueError(f"pipeline={self.pipeline!r}: use 'auto', True, False, 'spmd' or "
                             "'mpmd'")
        check_schedule(self.schedule)
        if self.model_constraints not in MODEL_CONSTRAINTS:
            raise ValueError(f"model_constraints={self.model_constraints!r}: use 'hint' (the "
                             "model's constraints held, priced) or 'ignore' (laid out by the "
                             "planner)")
        m = self.grad_accumulation
        if not (m == "auto" or (isinstance(m, int) and not isinstance(m, bool) and m >= 1)):
            raise ValueError(f"grad_accumulation={m!r}: use 'auto' or a number of "
                             "micro-batches >= 1")
        if isinstance(m, int) and m > 1 and self.pipeline in (True, "spmd", "mpmd"):
            raise ValueError(f"grad_accumulation={m} accumulates the gradients of one program; "
                             f"pipeline={self.pipeline!r} micro-batches its stages itself: pass "
                             "num_micro_batches= for the pipeline, or pipeline=False")
        if not (isinstance(self.remat, bool) or self.remat == "auto"):
            raise ValueError(f"remat={self.remat!r}: use 'auto', True or False")
        if self.remat is True and self.pipeline in (True, "spmd", "mpmd"):
            raise ValueError(f"remat=True rematerializes the layers of one program; pipeline="
                             f"{self.pipeline!r} plans stages as written: pass pipeline=False, "
                             "or remat='auto'")
        if not self.time_limit > 0:
            raise ValueError(f"time_limit={self.time_limit!r}: give seconds > 0")
        if not self.while_trips >= 1:
            raise ValueError(f"while_trips={self.while_trips!r}: give iterations >= 1")
        if self.workers < 1:
            raise ValueError(f"workers={self.workers!r}: give at least 1 solver thread")

    @classmethod
    def make(cls, *, memory_budget=None, state_argnums: Sequence[int] | None = None,
             batch_argnums: Sequence[int] | None = None, **fields) -> SearchOptions:
        """SearchOptions from loose user values: a budget string, argnums as any sequence."""
        return cls(memory_budget=parse_bytes(memory_budget),
                   state_argnums=None if state_argnums is None else tuple(state_argnums),
                   batch_argnums=None if batch_argnums is None else tuple(batch_argnums),
                   **fields)

    def replace(self, **changes) -> SearchOptions:
        return dataclasses.replace(self, **changes)


DEFAULTS = SearchOptions()
