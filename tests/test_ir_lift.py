"""The graph of a jaxpr: nodes, inlining, flops, roles and state ties."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shardplan import _compat
from shardplan.analysis import hlo_flops
from shardplan.ir.graph import Role
from shardplan.ir.lift import LiftOptions, lift
from shardplan.ir.trace import trace


def test_dot_flops_exact():
    g = lift(jax.make_jaxpr(lambda a, b: jnp.einsum("bij,bjk->bik", a, b))(
        jnp.ones((3, 4, 5)), jnp.ones((3, 5, 6))))
    (node,) = [n for n in g.nodes if n.primitive == "dot_general"]
    assert node.flops == 2 * 3 * 4 * 5 * 6


@pytest.mark.parametrize("padding,strides", [("VALID", (1, 1)), ("SAME", (1, 1)),
                                             ("SAME", (2, 2)), ("SAME", (2, 1))])
def test_conv_flops_match_xla(padding, strides):
    """Exact, padding excluded as XLA counts it; the gradients (dilated convs) too."""
    def f(x, w):
        y = jax.lax.conv_general_dilated(x, w, strides, padding,
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.sum(y ** 2)

    x, w = jnp.ones((2, 9, 8, 3)), jnp.ones((3, 3, 3, 16))
    for fn in (f, jax.grad(f, argnums=(0, 1))):
        g = lift(jax.make_jaxpr(fn)(x, w))
        conv = sum(n.flops for n in g.nodes if n.primitive == "conv_general_dilated")
        other = g.flops - conv
        xla = _compat.cost_analysis(jax.jit(fn).lower(x, w).compile())["flops"]
        assert conv + other == pytest.approx(xla, rel=0.02)


def test_jit_and_custom_jvp_inlined():
    @jax.jit
    def inner(x):
        return jax.nn.relu(x) * 2.0

    def f(x):
        return jax.nn.gelu(inner(x)) + jax.nn.softplus(x)

    g = lift(jax.make_jaxpr(f)(jnp.ones((4, 4))))
    prims = set(g.primitive_counts())
    assert "jit" not in prims and "pjit" not in prims
    assert "custom_jvp_call" not in prims
    assert "max" in prims  # relu's body, inlined from custom_jvp inside jit


def test_remat_and_custom_vjp_inlined():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))

    def loss(x):
        return jnp.sum(jax.checkpoint(lambda y: f(y) * y)(x))

    g = lift(jax.make_jaxpr(jax.grad(loss))(jnp.ones((8,))))
    prims = set(g.primitive_counts())
    assert not prims & {"remat", "checkpoint", "custom_vjp_call", "custom_vjp_call_jaxpr"}
    assert "sin" in prims and "cos" in prims


def test_scan_inlined_once_with_its_trip_count():
    def f(x):
        def body(c, _):
            return c @ c, None
        return jax.lax.scan(body, x, None, length=3)[0]

    g = lift(jax.make_jaxpr(f)(jnp.ones((4, 4))))
    (loop,) = g.loops
    assert loop.kind == "scan" and loop.trips == 3
    (dot,) = [n for n in g.nodes if n.primitive == "dot_general"]
    assert dot.trips == 3 and dot.loop == 0 and dot.flops == 2 * 4 * 4 * 4
    assert g.flops == 3 * 2 * 4 * 4 * 4
    assert g.primitive_counts() == {"dot_general": 1, "loop_carry": 1, "loop_result": 1}
    # the body's new carry is resharded into the carry's layout every iteration
    (carry,) = loop.carry_values(g)
    assert g.carry_edges() == [(dot.outputs[0], carry, 3.0)]


def test_scan_kept_opaque_without_loops():
    def f(x):
        def body(c, _):
            return c @ c, None
        return jax.lax.scan(body, x, None, length=3)[0]

    g = lift(jax.make_jaxpr(f)(jnp.ones((4, 4))), options=LiftOptions(loops=False))
    (scan,) = [n for n in g.nodes if n.primitive == "scan"]
    assert len(scan.subgraphs) == 1
    assert scan.flops == 3 * 2 * 4 * 4 * 4


def test_cond_and_while_inlined():
    def f(x, p):
        y = jax.lax.cond(p, lambda v: v * 2, lambda v: v @ v, x)
        return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] + 1, c[1] + 1), (y, 0))[0]

    g = lift(jax.make_jaxpr(f)(jnp.ones((4, 4)), True), options=LiftOptions(while_trips=5))
    assert [loop.kind for loop in g.loops] == ["cond", "while"]
    cond, loop = g.loops
    assert len(cond.bodies) == 2 and len(loop.bodies) == 2
    prims = g.primitive_counts()
    assert prims["cond_merge"] == 1 and prims["loop_carry"] == 2 and prims["lt"] == 1
    (dot,) = [n for n in g.nodes if n.primitive == "dot_general"]
    assert dot.trips == 1 and dot.flops == 2 * 4 ** 3
    (add,) = [n for n in g.nodes if n.primitive == "add" and g.values[n.outputs[0]].ndim == 2]
    assert add.trips == 5


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(256)(x)
        x = nn.Dropout(0.1, deterministic=not train)(nn.gelu(x))
        x = nn.LayerNorm()(x)
        return nn.Dense(64)(x)


def _flax_step():
    model, opt = _MLP(), optax.adamw(1e-3)
    x, y = jnp.ones((256, 128)), jnp.ones((256, 64))
    params = model.init(jax.random.key(0), x, train=False)
    opt_state = opt.init(params)

    def step(params, opt_state, batch, rng):
        def loss_fn(p):
            out = model.apply(p, batch["x"], rngs={"dropout": rng})
            return jnp.mean((out - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, opt_state, {"x": x, "y": y}, jax.random.key(1))


def test_flax_train_step_roles_ties_and_flops():
    step, args = _flax_step()
    traced = trace(step, args)
    g = lift(traced.closed_jaxpr, traced.arg_info)
    n_params = len(jax.tree_util.tree_leaves(args[0]))
    n_opt = len(jax.tree_util.tree_leaves(args[1]))
    assert traced.state_argnums == (0, 1)
    roles = g.input_roles
    assert roles[: n_params + n_opt] == (Role.STATE,) * (n_params + n_opt)
    assert roles[n_params + n_opt:] == (Role.BATCH, Role.BATCH, Role.OTHER)
    # new params and new optimizer state are tied to their inputs, the loss to nothing
    assert g.output_ties == tuple(range(n_params + n_opt)) + (None,)
    for j, i in enumerate(g.output_ties[:-1]):
        assert g.values[g.outputs[j]].shape == g.values[g.inputs[i]].shape
    # 3 matmuls per dense layer (fwd, two grads) minus the unneeded input grad of the first
    assert g.primitive_counts()["dot_general"] == 5
    compiled = jax.jit(step).lower(*args).compile()
    # XLA counts a loop's body once (threefry's rounds): its loops at their trip counts
    xla = (_compat.cost_analysis(compiled)["flops"]
           + hlo_flops.loop_extra_flops(compiled.as_text()))
    assert g.flops == pytest.approx(xla, rel=0.05)
    assert g.state_bytes() == sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(args[:2]))


def test_explicit_state_argnums():
    def step(w, x):
        return w - 0.1 * x.sum(0), jnp.sum(w)

    traced = trace(step, (jnp.ones((4,)), jnp.ones((8, 4))), state_argnums=(0,))
    assert traced.arg_info.roles == (Role.STATE, Role.BATCH)
    assert traced.arg_info.ties == (0, None)
    with pytest.raises(ValueError, match="state_argnums"):
        trace(step, (jnp.ones((4,)), jnp.ones((8, 4))), state_argnums=(5,))


def test_reduce_window_body_not_inlined():
    def f(x):
        return jax.lax.reduce_window(x, 1.0, lambda a, b: a * b + 0.0, (2, 2), (2, 2), "VALID")

    g = lift(jax.make_jaxpr(f)(jnp.ones((4, 4))))
    assert [n.primitive for n in g.nodes] == ["reduce_window"]
    assert len(g.nodes[0].subgraphs) == 1
