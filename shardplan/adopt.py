"""A given plan checked against the step it is to run (shardplan.auto(plan=...), a plan from
the cache): the step rewritten as the plan says (accumulated, rematerialized), the plan's mesh,
inputs, outputs and specs matched to it; what does not apply raises a ValueError that says to
plan again (tests/test_api.py, tests/test_cache_hardening.py)."""

from __future__ import annotations

import dataclasses

from shardplan import _compat
from shardplan import fingerprint as fingerprint_mod
from shardplan.ir.lift import lift
from shardplan.ir.trace import TracedStep
from shardplan.options import SearchOptions
from shardplan.plan import Plan
from shardplan.planning import accumulation
from shardplan.strategies.spec import MeshShape


def adopt(plan: Plan, traced: TracedStep, mesh, fn, args, options: SearchOptions):
    """The given plan checked against the step it is to run: (the plan on `mesh`, the graph).
    A different function only warns (the user may have edited it in a way that keeps the
    plan valid); different inputs or another mesh raise, as do specs that cannot apply."""
    step = accumulation.step_for(plan, traced, fn, args, options)
    graph = lift(step.closed_jaxpr, step.arg_info)
    again = "plan the step again (shardplan.auto without plan=, or shardplan.search)"
    actual = MeshShape.of(mesh)
    if tuple(plan.mesh.names) != tuple(actual.names) or tuple(plan.mesh.sizes) != tuple(actual.sizes):
        raise ValueError(f"the given plan is for mesh {mesh_text(plan.mesh)}, this mesh is "
                         f"{mesh_text(actual)}: use a mesh with the plan's axis names and sizes, "
                         f"or {again}")
    if plan.stages:
        raise ValueError("the given plan is a pipeline plan: running a saved pipeline plan is "
                         f"not supported; {again} with pipeline=...")
    if len(plan.input_specs) != len(graph.inputs) or len(plan.output_specs) != len(graph.outputs):
        raise ValueError("the given plan was made for a step with "
                         f"{len(plan.input_specs)} inputs and {len(plan.output_specs)} outputs, "
                         f"this one has {len(graph.inputs)} and {len(graph.outputs)}: {again}")
    if plan.fingerprint is not None:
        mine = fingerprint_mod.of_step(traced, actual)
        if mine.inputs != plan.fingerprint.inputs:
            raise ValueError("the given plan was made for other inputs (their pytree, shapes or "
                             f"dtypes differ from this call's): {again}")
        if mine.function != plan.fingerprint.function:
            again = f"the plan was made for a different function: {again}"
            _compat.warn_at_caller("shardplan: the given plan was made for a different function "
                                   "(its jaxpr differs); it is run as it is, but plan again if "
                                   "the step's operations changed")
    values = [(f"input {n}", s, graph.value(v)) for n, s, v in
              zip(plan.input_names, plan.input_specs, graph.inputs)]
    values += [(f"output {n}", s, graph.value(v)) for n, s, v in
               zip(plan.output_names, plan.output_specs, graph.outputs)]
    ids = {v.id for v in graph.values}
    nodes = {n.id: n for n in graph.nodes}
    for vid, spec in plan.constraints.items():
        if vid not in ids:
            raise ValueError(f"the given plan constrains value {vid}, which this step's graph "
                             f"does not have: {again}")
        values.append((f"constrained value {vid}", spec, graph.value(vid)))
    for (nid, index), route in plan.operand_specs.items():
        node = nodes.get(nid)
        if node is None or not 0 <= index < len(node.inputs):
            raise ValueError(f"the given plan reshards operand {index} of node {nid}, which this "
                             f"step's graph does not have: {again}")
        values += [(f"operand {index} of node {nid}", s, graph.value(node.inputs[index]))
                   for s in route]
    for what, spec, value in values:
        if spec.ndim != value.ndim:
            raise ValueError(f"the given plan's spec {spec.to_partition_spec()} for {what} has "
                             f"{spec.ndim} dimensions, the value has {value.ndim} "
                             f"(shape {value.shape}): {again}")
        unknown = sorted(set(spec.used_axes()) - set(actual.names))
        if unknown:
            raise ValueError(f"the given plan's spec for {what} uses mesh axes {unknown}, not in "
                             f"the mesh's {list(actual.names)}: {again}")
    return dataclasses.replace(plan, in_tree=traced.in_tree, out_tree=traced.out_tree,
                               device_mesh=mesh), graph


def check_cached(plan: Plan, traced: TracedStep, mesh, fn, args,
                  options: SearchOptions) -> None:
    """ValueError unless a cached plan applies to the step as a given one must (_adopt), with
    every input and output spec dividing its value: else the cache ignores the entry
    (tests/test_cache_hardening.py)."""
    _, graph = adopt(plan, traced, mesh, fn, args, options)
    shape = MeshShape.of(mesh)
    for spec, v in zip((*plan.input_specs, *plan.output_specs), (*graph.inputs, *graph.outputs)):
        value = graph.value(v)
        if not spec.valid_for(value.shape, shape):
            raise ValueError(f"the spec {spec.to_partition_spec()} does not divide a value of "
                             f"shape {value.shape} on mesh {mesh_text(shape)}")


def mesh_text(m: MeshShape) -> str:
    return " x ".join(f"{n}={k}" for n, k in zip(m.names, m.sizes))
