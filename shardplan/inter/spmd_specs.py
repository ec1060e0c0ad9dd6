"""The layouts an SPMD pipeline's stage runs its layers in: the stage program's intra-op plan
(shardplan.inter.spmd_cost.Priced, the step on one micro-batch) matched equation by equation
to the loss's scan body (the layer), to the layer's backward jaxpr (shardplan.inter.
layer_backward) and to the head after the scan, for the emitter to hold them
(shardplan.inter.stage_body.stage_layers, shardplan.emit.spmd)."""

from __future__ import annotations

from shardplan import _compat
from shardplan._compat import Literal
from shardplan.inter import layer_backward, stage_body
from shardplan.inter.layer_scan import LossTrace
from shardplan.inter.spmd_cost import Priced, layer_loops
from shardplan.ir import interpret
from shardplan.strategies.spec import ShardSpec


def _outer_loop(stage: Priced, lt: LossTrace, backward: bool):
    """(the planned graph's outermost forward or backward scan over layers, its body's nodes
    that are not the loop's entry and exit), or None."""
    graph = stage.graph
    group = layer_loops(graph, lt)[1 if backward else 0]
    outer = [lp for lp in sorted(group) if graph.loops[lp].parent not in group]
    if not outer:
        return None
    loop = graph.loops[outer[0]]
    pseudo = set(loop.enter) | set(loop.leave)
    return loop, [graph.nodes[n] for n in loop.bodies[-1].nodes
                  if graph.nodes[n].loop == loop.id and n not in pseudo]


def stacked_specs(stage: Priced, lt: LossTrace) -> dict[int, ShardSpec]:
    """{k: spec}: the layout (per layer) the stage's plan gives the scan's stacked parameter k
    (its xs, in order) where its backward scan over layers slices it, matched by shape (where
    several share a shape, the dimensions all of them split alike). The pipeline holds a
    stage's parameters so before its loop of ticks and keeps them so for the backward: a
    weight the plan gathers once for all layers, XLA would otherwise keep split in the
    backward loop and gather at every layer and tick."""
    found = _outer_loop(stage, lt, backward=True)
    if found is None:
        return {}
    graph = stage.graph
    by_shape: dict[tuple, list] = {}
    for n in found[0].enter:
        node = graph.nodes[n]
        strategy = stage.intra.node_strategies.get(n)
        if node.primitive != "loop_slice" or strategy is None or not strategy.in_specs:
            continue
        spec = strategy.in_specs[0]
        if spec is None or spec.partial or not spec.dims:
            continue
        by_shape.setdefault(graph.values[node.inputs[0]].shape, []).append(spec.dims[1:])
    out = {}
    for k, shape in enumerate(lt.micro_scan.xs_shapes):
        dims = by_shape.get(tuple(shape))
        if dims:
            out[k] = ShardSpec(tuple(d if all(x[i] == d for x in dims) else ()
                                     for i, d in enumerate(dims[0])))
    return out


def body_operand_specs(stage: Priced, lt: LossTrace) -> dict[tuple[int, int], ShardSpec]:
    """The layouts the stage's intra-op plan reads each operand of the layer in: {(equation
    index in the loss's scan body, operand index): spec}, for the stage body to be held in
    (shardplan.inter.stage_body.stage_layers). The planned graph's forward scan body is the
    layer's equations with the residuals autodiff adds; the layer's equations are matched to
    its nodes in order by primitive and output shapes (an equation not found, or a call such as
    remat whose body the graph inlined, is left to XLA). Partial specs are left out. A
    matmul's result too, under (i, -1): its operands alone held, XLA may compute it in another
    layout (the activation gathered whole at every layer and tick, where the plan computes it
    by sequence and moves the result all-to-all:
    tests/test_emit_spmd.py::test_a_dot_gives_its_result_in_the_plans_layout)."""
    found = _outer_loop(stage, lt, backward=False)
    if found is None:
        return {}
    body = lt.micro.jaxpr.eqns[lt.micro_scan.index].params["jaxpr"].jaxpr
    eqns = interpret.leaf_eqns(body)
    specs = _matched_specs(eqns, found[1], stage, results=True)
    return {(i, j): v for (i, j), v in specs.items()
            if j >= 0 or eqns[i].primitive.name == "dot_general"}


def body_backward_specs(stage: Priced, lt: LossTrace,
                        forward: dict[tuple[int, int], ShardSpec]
                        ) -> dict[tuple[int, int], ShardSpec]:
    """The layouts the stage's intra-op plan reads each operand of the layer's backward in:
    {(equation of the layer's backward jaxpr, layer_backward's numbering; operand; results
    under negative operands): spec}, matched in order to the planned graph's backward scan
    over layers (as body_operand_specs), for the pipeline's layers to run their backward as
    the plan does (shardplan.inter.layer_backward). Empty where autodiff of the forward in
    its layouts (`forward`, body_operand_specs) gives every layer parameter's gradient in
    the layout the plan's backward gives it: a constraint transposes to the same constraint
    on the cotangent, so a weight the forward reads whole gets its gradient reduced whole
    where the plan computes it split, every layer and tick
    (tests/test_emit_spmd.py::test_scanned_gpt_spmd_pipeline_equals_the_single_device_step
    runs a GPT whose plan differs so)."""
    found = _outer_loop(stage, lt, backward=True)
    if found is None:
        return {}
    graph, (loop, nodes) = stage.graph, found
    micro_eqn = lt.micro.jaxpr.eqns[lt.micro_scan.index]
    reads = stage_body.parameter_read_specs(micro_eqn, forward)
    grads: dict[tuple, set] = {}
    for n in loop.leave:
        node = graph.nodes[n]
        spec = stage.intra.value_specs.get(node.inputs[0]) if node.inputs else None
        if node.primitive == "loop_stack" and spec is not None and not spec.partial:
            grads.setdefault(graph.values[node.inputs[0]].shape, set()).add(spec.dims)
    first = len(micro_eqn.params["jaxpr"].in_avals) - (
        len(micro_eqn.invars) - sum(_compat.scan_counts(micro_eqn.params)))
    avals = micro_eqn.params["jaxpr"].in_avals[first:]
    if not any(grads.get(tuple(avals[k].shape), {spec.dims}) - {spec.dims}
               for k, spec in reads.items()):
        return {}
    closed = stage_body.layer_backward_jaxpr(micro_eqn)
    return _matched_specs(layer_backward.backward_eqns(closed), nodes, stage, results=True)


def post_operand_specs(stage: Priced, lt: LossTrace) -> dict[tuple[int, int], ShardSpec]:
    """The layouts the micro-batch step's plan `stage` reads each operand of the loss's
    equations after the scan over layers in (the head and loss, which 1F1B runs every tick):
    {(leaf equation index among them, operand index): spec}, matched in order to the plan's
    top-level nodes after its forward scan over layers (as body_operand_specs)."""
    found = _outer_loop(stage, lt, backward=False)
    if found is None:
        return {}
    after = max(found[0].leave)
    nodes = [n for n in stage.graph.nodes if n.loop is None and n.id > after]
    eqns = lt.micro.jaxpr.eqns[lt.micro_scan.index + 1:]
    return _matched_specs(interpret.leaf_eqns(eqns), nodes, stage)


def _matched_specs(eqns, nodes, p: Priced, results: bool = False
                   ) -> dict[tuple[int, int], ShardSpec]:
    """{(i, j): spec}: equation i of `eqns` matched to the next of `nodes` (in order) with its
    primitive and output shapes, its operand j read in that node's strategy's spec; with
    `results`, its result k given in it under (i, -1 - k) (partial specs left out)."""
    graph, intra = p.graph, p.intra
    out, at = {}, 0
    for i, eqn in enumerate(eqns):
        shapes = [tuple(v.aval.shape) for v in eqn.outvars]
        # the node's inputs: every operand, or (lift drops literals) the non-literal ones
        operands = [j for j, v in enumerate(eqn.invars) if not isinstance(v, Literal)]
        for k in range(at, len(nodes)):
            node = nodes[k]
            if (node.primitive != eqn.primitive.name
                    or [graph.values[v].shape for v in node.outputs] != shapes):
                continue
            if len(node.inputs) == len(eqn.invars):
                positions = list(range(len(eqn.invars)))
            elif len(node.inputs) == len(operands):
                positions = operands
            else:
                continue
            strategy = intra.node_strategies.get(node.id)
            for j, spec in zip(positions, strategy.in_specs if strategy else ()):
                v = eqn.invars[j]
                if (not isinstance(v, Literal) and spec is not None and not spec.partial
                        and spec.dims and len(spec.dims) == len(v.aval.shape)):
                    out[(i, j)] = spec
            for r, (v, spec) in enumerate(zip(eqn.outvars, strategy.out_specs if strategy and
                                              results else ())):
                if (spec is not None and not spec.partial and spec.dims
                        and len(spec.dims) == len(v.aval.shape)):
                    out[(i, -1 - r)] = spec
            at = k + 1
            break
    return out


