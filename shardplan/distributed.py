"""Multi-controller runs (`jax.distributed`, one process per host): one plan for every
process. The global arrays the step then takes are built by shardplan.global_inputs.

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
from shardplan.plan import Plan
from shardplan.plan_file import plan_from_dict
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
            plan = plan_from_dict(received)
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
