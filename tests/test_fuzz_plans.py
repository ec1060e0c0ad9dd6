"""Random small graphs (chains and diamonds of dot, elementwise, reshape, transpose, reduce
and broadcast ops) planned on 8 and 2x4 devices under random budgets: the planned program
computes what the unsharded one does, and a plan said to fit compiles within its budget."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardplan
from shardplan.analysis import hlo
from tests.conftest import auto_mesh

DIMS = (16, 32, 64)
OPS = ("dot", "tanh", "mul", "reshape", "transpose", "center", "scale_rows", "diamond")


@st.composite
def programs(draw):
    """(ops, shapes of the inputs): ops act on the running value h, a 2-D array; "dot" and
    "scale_rows" read a new input each."""
    rows, cols = draw(st.sampled_from(DIMS)), draw(st.sampled_from(DIMS))
    shapes, ops, shape = [(rows, cols)], [], (rows, cols)
    for op in draw(st.lists(st.sampled_from(OPS), min_size=1, max_size=5)):
        if op == "dot":
            out = draw(st.sampled_from(DIMS))
            shapes.append((shape[1], out))
            shape = (shape[0], out)
        elif op == "scale_rows":
            shapes.append((shape[0],))
        elif op == "reshape":
            if shape[0] % 32:
                continue
            shape = (shape[0] // 2, shape[1] * 2)
        elif op == "transpose":
            shape = shape[::-1]
        elif op == "diamond":
            shapes.append((shape[1], shape[1]))
        ops.append(op)
    return tuple(ops), tuple(shapes)


def build(ops):
    def f(*args):
        h, rest = args[0], list(args[1:])
        for op in ops:
            if op == "dot":
                h = h @ rest.pop(0)
            elif op == "tanh":
                h = jnp.tanh(h)
            elif op == "mul":
                h = h * h + 1.0
            elif op == "reshape":
                h = h.reshape(h.shape[0] // 2, h.shape[1] * 2)
            elif op == "transpose":
                h = h.T
            elif op == "center":  # a reduce, then a broadcast back
                h = h - jnp.mean(h, axis=1, keepdims=True)
            elif op == "scale_rows":  # a broadcast of a vector
                h = h * rest.pop(0)[:, None]
            elif op == "diamond":  # two branches from h, joined
                w = rest.pop(0)
                h = jnp.tanh(h @ w) + jnp.sin(h)
        return h, jnp.sum(h * h)

    return f


@settings(max_examples=24, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(program=programs(), mesh_shape=st.sampled_from([(8,), (2, 4)]),
       fraction=st.floats(0.15, 1.2))
def test_random_graphs_plan_right_and_fit(program, mesh_shape, fraction):
    ops, shapes = program
    f = build(ops)
    keys = jax.random.split(jax.random.key(len(ops) * 7 + len(shapes)), len(shapes))
    args = [jax.random.normal(k, s, jnp.float32) / np.sqrt(s[0]) for k, s in zip(keys, shapes)]
    want = jax.jit(f)(*args)
    mesh = auto_mesh(mesh_shape, ("x",) if len(mesh_shape) == 1 else ("data", "model"))
    # Replicated, every input and output is on every device: a fraction of that is a budget
    # some plans fit and some do not.
    out_bytes = sum(np.asarray(x).nbytes for x in want)
    budget = max(1, int(fraction * (sum(a.nbytes for a in args) + out_bytes)))
    step = shardplan.auto(f, mesh=mesh, memory_budget=budget, hardware="cpu", time_limit=20,
                          deterministic=True)
    try:
        plan = step.plan(*args)
    except shardplan.InfeasibleMemory as e:
        assert e.min_bytes > budget
        return
    assert plan.estimate.peak_bytes <= budget
    peak = hlo.analyze(step.lower(*args).compile()).peak_bytes
    assert peak <= budget, (ops, shapes, mesh_shape, budget, plan.estimate.peak_bytes, peak)
    got = step(*args)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("ops", [("dot", "tanh", "dot"), ("diamond", "center", "transpose")])
def test_the_fuzzer_builds_what_it_means(ops):
    """The builder's shapes line up with the drawn inputs (the fuzz test relies on it)."""
    shapes = [(32, 16), (16, 32), (32, 64)] if ops[0] == "dot" else [(32, 16), (16, 16)]
    args = [jnp.ones(s) for s in shapes]
    h, loss = build(ops)(*args)
    assert h.ndim == 2 and loss.shape == ()
