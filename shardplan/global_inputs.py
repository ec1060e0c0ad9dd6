"""The global arrays a planned step takes, built from each process's own data under
jax.distributed: a process's rows of the batch, full copies of the state. Each input is placed
as the plan's in_shardings say (tests/test_global_inputs.py on one process,
tests/test_multihost.py with two)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from shardplan.ir.graph import Role
from shardplan.ir.trace import trace
from shardplan.plan import Plan


def global_args(step_or_plan, *args, local_argnums: Sequence[int] | None = None) -> tuple:
    """The global arrays a planned step takes, from each process's own data.

    Under jax.distributed, call it in every process with the step's arguments as that process
    holds them, then call the step with what it returns. With one process it places the
    arguments as the plan says.

    Args:
      step_or_plan: an AutoStep (planned here for the global shapes, if it was not yet), or a
        Plan made on a device mesh (then give `local_argnums`).
      *args: the step's arguments. Those in `local_argnums` are this process's rows of the
        global value, split along the first axis in process order (process p holds rows
        p*n .. (p+1)*n - 1 of the n * process_count global rows); they are placed with
        jax.make_array_from_process_local_data where the plan gives each process exactly its
        own rows, else gathered from every process first. Every other argument (parameters,
        optimizer state) is a full copy of the global value, equal in every process, placed
        with jax.make_array_from_callback. Global jax.Arrays (such as the previous step's
        outputs) are passed through.
      local_argnums: which arguments are process-local rows; default the arguments the
        step's trace calls batch.

    Returns:
      The tuple of global arguments to call the step with.
    """
    args = tuple(args)
    if isinstance(step_or_plan, Plan):
        if local_argnums is None:
            raise ValueError("global_args(plan, ...) needs local_argnums= (which arguments are "
                             "this process's rows of the batch); or pass the step instead")
        local_argnums = _local_argnums(local_argnums, len(args))
        plan = step_or_plan  # one with no device mesh says so in plan.in_shardings
    else:
        if not (callable(getattr(step_or_plan, "plan", None))
                and hasattr(step_or_plan, "options")):
            raise TypeError("global_args takes the step shardplan.auto returned (or a Plan made "
                            f"on a device mesh), got {type(step_or_plan).__name__} "
                            f"{step_or_plan!r:.60}: wrap the function, step = "
                            "shardplan.auto(fn, mesh=mesh)")
        if local_argnums is None:
            local_argnums = _batch_argnums(step_or_plan, args)
        local_argnums = _local_argnums(local_argnums, len(args))
        plan = step_or_plan.plan(*global_shapes(args, local_argnums))
    local_argnums = tuple(sorted(local_argnums))
    shardings = plan.in_shardings
    if len(shardings) != len(args):
        raise ValueError(f"the plan takes {len(shardings)} arguments, {len(args)} were given")
    return tuple(
        jax.tree_util.tree_map(
            lambda x, s, local=(i in local_argnums): _global_leaf(x, s, local), a, sh)
        for i, (a, sh) in enumerate(zip(args, shardings)))


def _local_argnums(local_argnums, count: int) -> tuple[int, ...]:
    """`local_argnums` (an int or ints, negative from the end) as positions in 0..count-1;
    otherwise a TypeError or ValueError saying what is wrong, an out-of-range position
    included (tests/test_hardening.py::test_global_args_misuse_is_named)."""
    if isinstance(local_argnums, int) and not isinstance(local_argnums, bool):
        local_argnums = (local_argnums,)
    if (isinstance(local_argnums, str) or not isinstance(local_argnums, Sequence)
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in local_argnums)):
        raise TypeError(f"local_argnums must be an int or a tuple of ints (argument positions), "
                        f"got {type(local_argnums).__name__} {local_argnums!r:.60}")
    bad = [i for i in local_argnums if not -count <= i < count]
    if bad:
        raise ValueError(f"local_argnums has {bad[0]}, but {count} arguments were given "
                         f"(positions 0 to {count - 1})")
    return tuple(sorted({i % count for i in local_argnums}))


def global_shapes(args: Sequence, local_argnums: Sequence[int]) -> tuple:
    """ShapeDtypeStructs of the global arguments: the local arguments' first axis times the
    number of processes, the others as they are."""
    n = jax.process_count()

    def shape(x, local):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        s = np.shape(x)
        if local and s:
            s = (s[0] * n, *s[1:])
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        return jax.ShapeDtypeStruct(s, dtype)

    return tuple(jax.tree_util.tree_map(lambda x, i=i: shape(x, i in local_argnums), a)
                 for i, a in enumerate(args))


def _batch_argnums(step, args) -> tuple[int, ...]:
    """The arguments the step's trace calls batch (all leaves batch), from the local shapes;
    remembered on the step per signature, so a training loop traces once
    (tests/test_global_inputs.py::test_global_args_traces_the_step_once_per_signature)."""
    o = step.options
    if getattr(o, "batch_argnums", None) is not None:
        return tuple(o.batch_argnums)
    leaves, tree = jax.tree_util.tree_flatten(args)
    key = (tree, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves))
    memo = vars(step).setdefault("_global_args_batch_argnums", {})
    if key not in memo:
        memo[key] = _traced_batch_argnums(step.fn, args, getattr(o, "state_argnums", None))
    return memo[key]


def _traced_batch_argnums(fn, args, state_argnums) -> tuple[int, ...]:
    traced = trace(fn, args, state_argnums, None)
    roles = list(traced.arg_info.roles)
    out, start = [], 0
    for i, count in enumerate(traced.arg_leaf_counts):
        mine = roles[start:start + count]
        start += count
        if mine and all(r == Role.BATCH for r in mine):
            out.append(i)
    return tuple(out)


def _global_leaf(x, sharding, local: bool):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x  # already global (e.g. the previous step's output)
    x = np.asarray(x)
    n = jax.process_count()
    if not local or x.ndim == 0:
        # dtype: a process that owns none of the devices (an MPMD pipeline's stage) holds none
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx], dtype=x.dtype)
    shape = (x.shape[0] * n, *x.shape[1:])
    if owns_own_rows(sharding, shape):
        return jax.make_array_from_process_local_data(sharding, x, shape)
    # The plan gives some process rows another holds (e.g. a batch replicated across hosts):
    # gather the whole batch, then let every device take its part.
    full = np.asarray(multihost_utils.process_allgather(x, tiled=True)) if n > 1 else x
    return jax.make_array_from_callback(shape, sharding, lambda idx: full[idx], dtype=x.dtype)


def owns_own_rows(sharding, global_shape: Sequence[int]) -> bool:
    """Whether every process's devices need exactly that process's block of rows (process p:
    rows p*n .. (p+1)*n - 1) and whole other dimensions, as make_array_from_process_local_data
    expects of a process's rows. Decided on the whole sharding, so every process decides the
    same (the other path gathers, a collective)."""
    shape = tuple(global_shape)
    rows = shape[0] // jax.process_count()
    need: dict[int, list[tuple]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        need.setdefault(device.process_index, []).append(index)
    return all(covers_block(idx, shape, p * rows, (p + 1) * rows) for p, idx in need.items())


def covers_block(indices: Sequence[tuple], shape: Sequence[int], lo: int, hi: int) -> bool:
    """Whether the union of `indices` (tuples of slices into `shape`) is rows lo..hi-1 with
    whole other dimensions (tests/test_global_inputs.py::test_covers_block)."""
    starts, stops = [], []
    for index in indices:
        for d, sl in enumerate(index):
            start, stop, _ = sl.indices(shape[d])
            if d == 0:
                starts.append(start)
                stops.append(stop)
            elif (start, stop) != (0, shape[d]) and not _union_is_whole(indices, d, shape[d]):
                return False
    return bool(starts) and min(starts) == lo and max(stops) == hi and all(
        lo <= s and t <= hi for s, t in zip(starts, stops))


def _union_is_whole(indices, d: int, size: int) -> bool:
    covered = sorted(idx[d].indices(size)[:2] for idx in indices)
    end = 0
    for start, stop in covered:
        if start > end:
            return False
        end = max(end, stop)
    return end == size
