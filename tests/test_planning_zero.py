"""shardplan.planning.zero: the ZeRO stage of a plan's input layouts, over the axes that split
the batch, read from the step's graph (parameters are what its dots and gathers read; the
optimizer state is the rest of the state), and the plan's report line."""

import jax
import jax.numpy as jnp
import optax

import shardplan
from shardplan.ir.graph import Role
from shardplan.ir.lift import lift
from shardplan.ir.trace import trace
from shardplan.planning import zero
from shardplan.strategies.spec import MeshShape, ShardSpec

OPT = optax.adam(1e-2)
MESH = MeshShape(("data", "model"), (4, 2))


def _step(params, opt_state, batch):
    def loss(p):
        h = jnp.take(p["emb"], batch["ids"], axis=0)  # an embedding lookup: a gather
        h = jnp.tanh(h @ p["w1"].astype(jnp.float32) + p["b"])
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    grads = jax.grad(loss)(params)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _graph():
    params = {"emb": jnp.ones((64, 16)), "w1": jnp.ones((16, 32), jnp.bfloat16),
              "b": jnp.ones((32,)), "w2": jnp.ones((32, 8))}
    batch = {"ids": jnp.zeros((8,), jnp.int32), "y": jnp.ones((8, 8))}
    args = (params, OPT.init(params), batch)
    traced = trace(_step, args, state_argnums=(0, 1), batch_argnums=(2,))
    return lift(traced.closed_jaxpr, traced.arg_info)


def _specs(graph, params_split: bool, state_split: bool, batch_axis: tuple = ("data",)):
    """Layouts: the batch's rows over `batch_axis`; a parameter's (the first four state
    inputs) and the rest of the state's first dimension over data where asked."""
    found = zero.parameters(graph)
    out = []
    for i, v in enumerate(graph.inputs):
        ndim = graph.values[v].ndim
        role = graph.input_roles[i]
        split = (role is Role.BATCH and batch_axis) or (
            role is Role.STATE and (params_split if i in found else state_split))
        dims = ((batch_axis if role is Role.BATCH else ("data",)) if split and ndim else ())
        out.append(ShardSpec((dims,) + ((),) * (ndim - 1) if ndim else ()))
    return out


def test_parameters_are_what_dots_and_gathers_read_through_moves():
    g = _graph()
    names = [g.input_names[i] for i in sorted(zero.parameters(g))]
    # emb (gathered), w1 (read through a convert), w2: not the bias, not adam's mu, nu, count
    assert names == ["[0]['emb']", "[0]['w1']", "[0]['w2']"], names


def test_the_stage_follows_what_is_split_over_the_data_axes():
    g = _graph()
    assert zero.data_axes(g, _specs(g, False, False), MESH) == ("data",)
    assert zero.describe(g, _specs(g, False, False), MESH).startswith("ZeRO-0")
    assert zero.describe(g, _specs(g, False, True), MESH).startswith("ZeRO-2")
    line = zero.describe(g, _specs(g, True, True), MESH)
    assert line.startswith("ZeRO-3") and "parameters 100%" in line, line
    # the batch not split: no data axes, no ZeRO; a split over a 1-device axis is none either
    assert "none" in zero.describe(g, _specs(g, True, True, ()), MESH)
    one = MeshShape(("data", "model"), (1, 8))
    assert zero.data_axes(g, _specs(g, False, False), one) == ()


def test_a_searched_plan_reports_its_stage_and_keeps_it_in_its_file(tmp_path):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params = {"emb": jnp.ones((64, 16)), "w1": jnp.ones((16, 32), jnp.bfloat16),
              "b": jnp.ones((32,)), "w2": jnp.ones((32, 8))}
    batch = {"ids": jnp.zeros((64,), jnp.int32), "y": jnp.ones((64, 8))}
    step = shardplan.auto(_step, mesh=mesh, state_argnums=(0, 1), batch_argnums=(2,),
                          cache=False, deterministic=True, time_limit=10)
    args = (params, OPT.init(params), batch)
    plan = step.plan(*args)
    traced = trace(_step, args, state_argnums=(0, 1), batch_argnums=(2,))
    graph = lift(traced.closed_jaxpr, traced.arg_info)
    assert plan.zero == zero.describe(graph, plan.input_specs, plan.mesh)
    assert plan.zero.startswith("ZeRO") and plan.zero in plan.summary()
    plan.save(tmp_path / "plan.json")
    assert shardplan.load_plan(tmp_path / "plan.json").zero == plan.zero
