"""Multi-controller runs (`jax.distributed`, one process per host): one plan for every
process, and the global arrays a planned step takes, built from each process's data.

Every process of a job must run the same program: a plan that differs by one spec between
processes makes their collectives disagree, which hangs or corrupts the step. So before the
first step the processes compare the step's fingerprint, process 0 plans (or loads the plan
from the cache) and broadcasts it, and all compare the plan's fingerprint, also when each was
given its own plan with `plan=`. Any difference, or a failure in any process, raises the same
error in every process, naming what differed: nothing waits on a collective that another
process will never reach.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from shardplan import fingerprint as fp_mod
from shardplan.ir.graph import Role
from shardplan.ir.trace import trace
from shardplan.plan import Plan
from shardplan.planning.pipelines import Choice, choose, plan_spmd
from shardplan.planning.spmd_pipeline import probe_spmd


class PlanMismatchError(RuntimeError):
    """The processes of a multi-controller job would run different plans (or steps)."""


def process_count() -> int:
    return jax.process_count()


def is_multi_controller() -> bool:
    """True in a jax.distributed run with more than one process."""
    return jax.process_count() > 1


def default_mesh():
    """Under jax.distributed, a mesh of all processes' devices with the hosts along the first
    (slow) axis: axes ("hosts", "devices") of sizes (processes, devices per process). None
    with one process (the caller's one-axis default applies)."""
    if not is_multi_controller():
        return None
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    hosts = jax.process_count()
    if len(devices) % hosts:
        return None  # uneven hosts: one axis over every device
    auto = jax.sharding.AxisType.Auto
    return jax.sharding.Mesh(np.asarray(devices).reshape(hosts, -1), ("hosts", "devices"),
                             axis_types=(auto, auto))


def plan_pipeline_once(fn, args, mesh, hardware, options, traced, cache=None, *,
                       donate_argnums=()):
    """The pipeline of a multi-controller step: (Plan, the PipelinePlan of an MPMD pipeline or
    None for an SPMD one).

    The SPMD pipeline where it applies (pipeline=True or "spmd"): process 0 plans it and
    broadcasts it. Else the MPMD pipeline (shardplan.emit.pipeline runs it multi-controller):
    the runtime needs the planner's split step and per-stage layouts, which a plan file does
    not hold, so every process plans it (the planner is deterministic: fixed solver seed and
    workers) and the processes compare the plans and every stage's layouts before the first
    step. An SPMD plan goes through `cache` (a shardplan.cache.PlanCache, or None), read and
    written by process 0."""
    if options.pipeline != "mpmd":
        why = probe_spmd(fn, args, mesh, options)
        if not isinstance(why, str):
            step_fp = fp_mod.step_fingerprint(traced, mesh, hardware, options,
                                              donate_argnums=donate_argnums)

            def plan_it():
                spmd = plan_spmd(fn, args, mesh, hardware, options, traced)
                if isinstance(spmd, str):  # probe_spmd said yes: planning should agree
                    raise RuntimeError(f"no SPMD pipeline: {spmd}")  # noqa: TRY004
                return spmd.plan

            plan = plan_once(step_fp, lambda: _spmd_cached(cache, step_fp, plan_it))
            return dataclasses.replace(plan, in_tree=traced.in_tree,
                                       out_tree=traced.out_tree), None
        if options.pipeline == "spmd":
            raise ValueError(f"pipeline='spmd': no SPMD pipeline: {why}; use pipeline=True "
                             "(MPMD stages where the layers are not one scan) or False")
    found = {}

    def obtain_mpmd():
        found["choice"] = choice = choose(fn, args, mesh, hardware, options, traced=traced)
        return choice.plan

    plan = plan_once(fp_mod.step_fingerprint(traced, mesh, hardware, options,
                                             donate_argnums=donate_argnums), obtain_mpmd,
                     broadcast=False)
    pp = found["choice"].pipeline
    _agree_layouts(pp)
    return plan, pp


def plan_auto_once(traced, mesh, hardware, options, decide: Callable[[], Choice],
                   cache=None, *, donate_argnums=()) -> tuple[Plan, object]:
    """pipeline="auto" in a multi-controller job: (Plan, the PipelinePlan of an MPMD
    pipeline or None).

    Process 0 decides (`decide()`: the cost model's, or the measured, choice between one
    program, an SPMD pipeline and an MPMD pipeline; an SPMD plan from `cache` if it holds
    one) and broadcasts the plan; every process compares its fingerprint, which covers the
    pipeline kind, the stages and the schedule, so all emit the same kind of program. One
    program or an SPMD pipeline is then emitted from the broadcast plan. An MPMD pipeline's
    runtime needs the planner's split step and per-stage layouts, which a plan does not hold:
    then the other processes run `decide()` too (deterministic), and every process checks
    that it chose process 0's plan and that the stages lay out their values alike, before
    the first step."""
    step_fp = fp_mod.step_fingerprint(traced, mesh, hardware, options,
                                      donate_argnums=donate_argnums)
    mine: dict[str, Choice] = {}

    def plan_it() -> Plan:
        mine["choice"] = choice = decide()
        return choice.plan

    plan = plan_once(step_fp, lambda: _spmd_cached(cache, step_fp, plan_it))
    if plan.pipeline_kind != "mpmd":
        return dataclasses.replace(plan, in_tree=traced.in_tree, out_tree=traced.out_tree), None
    if "choice" in mine:
        choice, error = mine["choice"], None
    else:
        choice, error = _attempt(decide)
    if error is not None:
        status = f"failed to plan the MPMD pipeline process 0 chose: {_error_text(error)}"
    elif choice.pipeline is None or choice.plan.pipeline_kind != "mpmd":
        status = (f"chose {choice.plan.pipeline_kind or 'one program'} where process 0 chose "
                  "an MPMD pipeline")
    else:
        diff = fp_mod.first_difference(plan.to_dict(), choice.plan.to_dict())
        status = "" if diff is None else f"planned another MPMD pipeline: {diff}"
    got = _allgather_text(status)
    if any(got):
        if error is not None:
            raise error
        who = next(i for i, g in enumerate(got) if g)
        raise PlanMismatchError(
            f"pipeline='auto': process 0 chose an MPMD pipeline, which every process plans "
            f"itself, and process {who} {got[who]}: the planner was not deterministic here (a "
            "solver time limit reached under load?); raise time_limit=, or pass "
            "pipeline=False or 'spmd'")
    _agree_layouts(choice.pipeline)
    return choice.plan, choice.pipeline


def _spmd_cached(cache, step_fp: str, plan_it: Callable[[], Plan]) -> Plan:
    """The SPMD pipeline plan `cache` holds for `step_fp`, else `plan_it()` (stored there if it
    is one: an MPMD plan is rebuilt by the pipeline planner, which its JSON cannot stand in
    for; one program's plan under pipeline="auto" is chosen again)."""
    hit = cache.load(step_fp) if cache is not None else None
    if hit is not None and hit.pipeline_kind == "spmd":
        return hit
    plan = plan_it()
    if cache is not None and plan.pipeline_kind == "spmd":
        cache.store(step_fp, dataclasses.replace(plan, device_mesh=None))
    return plan


def _agree_layouts(pp) -> None:
    """Every process's MPMD pipeline lays out its stages' values alike, else
    PlanMismatchError in every process."""
    layouts = fp_mod.digest(repr([sorted((v, str(sp)) for v, sp in stage.items())
                                  for stage in pp.specs]))
    got = _allgather_text(layouts)
    if len(set(got)) > 1:
        raise PlanMismatchError(
            "the processes planned MPMD pipelines whose stages lay out their values "
            f"differently (layout digests: {_group(got)}), though their plans agree on the "
            "inputs, outputs and stages: the planner was not deterministic here (a solver time "
            "limit reached under load?); raise time_limit=, or plan once and pass "
            "pipeline=False")


def plan_once(step_fingerprint: str, obtain: Callable[[], Plan], *,
              broadcast: bool = True) -> Plan:
    """The plan every process runs.

    One process: `obtain()`. Several: the step fingerprints are compared; with `broadcast`
    process 0 runs `obtain()` (plans, or loads the cached plan) and sends the plan to the
    others, else every process runs `obtain()` (its `plan=`); then the plans' fingerprints are
    compared. A difference or a failure raises PlanMismatchError in every process (the process
    that failed raises its own exception).
    """
    if not is_multi_controller():
        return obtain()
    me = jax.process_index()
    fps = _allgather_text(step_fingerprint)
    if len(set(fps)) > 1:
        groups = _group(fps)
        raise PlanMismatchError(
            "the processes traced different steps or plan with different meshes, hardware "
            f"profiles or options (step fingerprints differ: {groups}); every process must "
            "call the step with arguments of the same global shapes and the same options")

    plan, error = None, None
    if broadcast:
        if me == 0:
            plan, error = _attempt(obtain)
            text = _plan_json(plan) if error is None else _error_json(error)
        else:
            text = ""
        text = _broadcast_text(text)
        if error is not None:
            raise error  # the others raise "process 0 failed" from the broadcast
        if me != 0:
            received = json.loads(text)
            if "error" in received:
                raise PlanMismatchError(f"process 0 failed to plan the step: {received['error']}")
            plan = Plan.from_dict(received)
    else:
        plan, error = _attempt(obtain)

    mine = (fp_mod.plan_fingerprint(plan) if error is None
            else "error:" + fp_mod.digest(repr(error)))
    hashes = _allgather_text(mine)
    if len(set(hashes)) == 1:
        if error is not None:
            raise error  # every process failed alike (each planned itself)
        return plan
    # Slow path, only on a mismatch: every process gathers every plan to name the difference.
    texts = _allgather_text(_plan_json(plan) if error is None else _error_json(error))
    if error is not None:
        raise error
    raise PlanMismatchError(describe_mismatch([json.loads(t) for t in texts], me))


def describe_mismatch(plans: Sequence[dict], me: int = 0) -> str:
    """Why the processes' plans (Plan.to_dict() or {"error": ...}, by process index) differ."""
    failed = [(i, p["error"]) for i, p in enumerate(plans) if "error" in p]
    if failed:
        i, err = failed[0]
        return f"process {i} failed before the first step: {err}"
    ref = plans[0]
    for i, p in enumerate(plans[1:], 1):
        diff = fp_mod.first_difference(ref, p)
        if diff is not None:
            return (f"the processes would run different plans (process 0 vs process {i}, "
                    f"this is process {me}): first difference: {diff}. Every process must run "
                    "the same plan: pass the same plan= everywhere (e.g. one file saved by "
                    "process 0), or let shardplan plan once (no plan=) and broadcast it")
    return "the processes' plans differ in fingerprint but not in any spec (plan format?)"


def _attempt(obtain):
    try:
        return obtain(), None
    except Exception as e:  # noqa: BLE001 (carried to the other processes, re-raised here)
        return None, e


def _plan_json(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), sort_keys=True)


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _error_json(error: BaseException) -> str:
    return json.dumps({"error": _error_text(error)})


def _group(values: Sequence[str]) -> str:
    by: dict[str, list[int]] = {}
    for i, v in enumerate(values):
        by.setdefault(v, []).append(i)
    return "; ".join(f"processes {ids}: {v[:12]}" for v, ids in by.items())


def _broadcast_text(text: str) -> str:
    """`text` of process 0 in every process: its length first, then its bytes."""
    data = np.frombuffer(text.encode(), np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
    buf = data if jax.process_index() == 0 else np.zeros(n, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes().decode()


def _allgather_text(text: str) -> list[str]:
    """Every process's `text`, by process index."""
    data = np.frombuffer(text.encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(data.size))).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
    return [rows[i, :int(sizes[i])].tobytes().decode() for i in range(len(sizes))]


# -- the global inputs ---------------------------------------------------------------------------


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
    a TypeError or ValueError saying what is wrong otherwise (an out-of-range position was
    silently ignored: tests/test_hardening.py::test_global_args_misuse_is_named)."""
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
    remembered on the step per signature, so a training loop traces once."""
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
    whole other dimensions."""
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
