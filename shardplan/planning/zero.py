"""The ZeRO stage a plan amounts to (Rajbhandari et al., "ZeRO", 2020), as a report line.

Over the mesh axes that split the batch (the data axes), a plan that splits the optimizer
state is stage 1, and its gradients are then reduced into that split (a reduce-scatter where
the profile forms one: stage 2); one that splits the parameters too is stage 3 (FSDP). Each is
counted by bytes: the share of the parameters' bytes, and of the optimizer state's, whose
layout splits them over a data axis. The parameters are the state inputs a contraction (a dot,
a convolution) or a gather (an embedding lookup) reads through moves that keep their values (a
convert, a reshape, a scan's per-layer slice); the optimizer state is the rest of the state
(its moments, read by elementwise updates). Tensor-parallel splits over other axes are not
ZeRO and are not counted (tests/test_planning_zero.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from shardplan.ir import primitives
from shardplan.ir.graph import Graph, Role
from shardplan.strategies.spec import MeshShape, ShardSpec

# Families of ops that pass a state input's values on to a reader (one non-literal operand).
_MOVES = frozenset({"elementwise", "reshape", "transpose", "broadcast", "squeeze", "loop_slice",
                    "loop_same", "identity", "slice", "dynamic_slice"})
# Readers that make a state input a parameter, and which operands they read it as.
_READERS = {"dot": None, "conv": None, "gather": (0,)}
# A share of bytes from which a kind of state counts as split.
SPLIT = 0.5


def parameters(graph: Graph) -> set[int]:
    """Positions of the state inputs that are parameters (read by a contraction or a gather
    through moves alone)."""
    position = {v: i for i, v in enumerate(graph.inputs)
                if graph.input_roles[i] is Role.STATE}
    producer = {v: node for node in graph.nodes for v in node.outputs}
    found: set[int] = set()
    for node in graph.nodes:
        reads = _READERS.get(primitives.info(node.primitive).family, ())
        if reads == ():
            continue
        for k, v in enumerate(node.inputs):
            if reads is not None and k not in reads:
                continue
            seen = set()
            while v not in position and v in producer and v not in seen:
                seen.add(v)
                p = producer[v]
                live = [u for u in p.inputs if not graph.values[u].is_literal]
                if primitives.info(p.primitive).family not in _MOVES or len(live) != 1:
                    break
                v = live[0]
            if v in position:
                found.add(position[v])
    return found


def data_axes(graph: Graph, specs: Sequence[ShardSpec], mesh: MeshShape) -> tuple[str, ...]:
    """The mesh axes (of more than one device) that split a batch input's leading dimension."""
    axes: set[str] = set()
    for i, v in enumerate(graph.inputs):
        if graph.input_roles[i] is Role.BATCH and graph.values[v].ndim:
            axes.update(specs[i].dims[0])
    return tuple(a for a in mesh.names if a in axes and mesh.size(a) > 1)


def describe(graph: Graph, specs: Sequence[ShardSpec], mesh: MeshShape) -> str:
    """The report line: the ZeRO stage of `specs` (the flat inputs' layouts) and its shares."""
    axes = data_axes(graph, specs, mesh)
    state = [i for i, r in enumerate(graph.input_roles) if r is Role.STATE]
    if not state:
        return ""
    if not axes:
        return "ZeRO: none (no mesh axis splits the batch)"
    params = parameters(graph)

    def share(positions: list[int]) -> float | None:
        total = sum(graph.values[graph.inputs[i]].nbytes for i in positions)
        split = sum(graph.values[graph.inputs[i]].nbytes for i in positions
                    if any(a in axes for d in specs[i].dims for a in d))
        return split / total if total else None

    p = share([i for i in state if i in params])
    o = share([i for i in state if i not in params])
    over = "/".join(axes)
    shares = ", ".join(f"{what} {s:.0%}" for what, s in (("parameters", p),
                                                          ("optimizer state", o))
                       if s is not None)
    if p is not None and p >= SPLIT:
        stage = "ZeRO-3 (parameters, gradients and optimizer state split)"
    elif o is not None and o >= SPLIT:
        stage = "ZeRO-2 (optimizer state split, gradients reduced into its split)"
    else:
        stage = "ZeRO-0 (state replicated: plain data parallel)"
    return f"{stage} over {over}; bytes split over it: {shares}"
