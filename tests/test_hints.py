"""Hints: patterns and logical axis names pin input shardings; the planner plans the rest,
and the planned step computes what the single-device step does."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import shardplan
from shardplan.intra.hints import fixed_inputs, logical_to_mesh, matches
from shardplan.options import Hints, SearchOptions
from shardplan.strategies.spec import MeshShape, ShardSpec

MESH = MeshShape(("data", "model"), (2, 4))
RULES = [("batch", "data"), ("mlp", "model"), ("embed", None)]
PATHS = ["0/params/Dense_0/kernel", "0/params/Dense_0/bias", "0/params/Dense_1/kernel",
         "2/0", "2/1"]
SHAPES = [(32, 64), (64,), (64, 32), (12, 32), (12, 32)]


@pytest.mark.parametrize("pattern, path, hit", [
    ("0/params/Dense_0/kernel", "0/params/Dense_0/kernel", True),
    ("0/*/Dense_0/kernel", "0/params/Dense_0/kernel", True),
    ("0/*/kernel", "0/params/Dense_0/kernel", False),       # * is one component
    ("0/**/kernel", "0/params/Dense_0/kernel", True),
    ("**/kernel", "1/0/mu/params/Dense_0/kernel", True),
    ("**", "2/input_ids", True),
    ("2/**", "2", True),                                     # ** may be no component
    ("0/params/Dense_*/kernel", "0/params/Dense_1/kernel", True),
    ("0/params/Dense_*/kernel", "0/params/Dense_1/bias", False),
    ("1/**", "0/params/Dense_0/kernel", False),
])
def test_glob_patterns(pattern, path, hit):
    assert matches(pattern, path) is hit


def test_first_match_wins():
    hints = Hints([("0/**/kernel", P(None, "model")), ("0/**", P()), ("2/**", P("data"))])
    fixed = fixed_inputs(hints, PATHS, SHAPES, MESH)
    assert fixed == {0: ShardSpec(((), ("model",))), 1: ShardSpec(((),)),
                     2: ShardSpec(((), ("model",))), 3: ShardSpec((("data",), ())),
                     4: ShardSpec((("data",), ()))}


def test_users_values_are_normalised():
    as_dict = SearchOptions.make(hints={"2/**": P("data"), "0/**": [None, "model"]})
    as_pairs = SearchOptions(hints=[("2/**", ["data"]), ("0/**", (None, "model"))])
    assert as_dict == as_pairs and hash(as_dict) == hash(as_pairs)
    assert as_dict.hints.pins == (("2/**", P("data")), ("0/**", P(None, "model")))
    assert not SearchOptions().hints


@pytest.mark.parametrize("hints, words", [
    ({"0/params/Dense_0/kernel": P(None, None, "model")},
     ["0/params/Dense_0/kernel", "3 entries", "2 dimensions"]),
    ({"2/**": P("tensor")}, ["2/0", "'2/**'", "'tensor' is not a mesh axis", "data, model"]),
    ({"2/**": P(("data", "model"))}, ["'2/**'", "2/0", "dimension 0 of size 12",
                                      "8 pieces over data+model"]),
    ({"0/params/Dense_0/kernel": P("model", "model")}, ["twice"]),
    ({"0/params/Dense_9/*": P()}, ["match no input", "'0/params/Dense_9/*'",
                                   "0/params/Dense_0/kernel"]),
])
def test_bad_hints_name_the_input_pattern_and_problem(hints, words):
    with pytest.raises(ValueError) as info:
        fixed_inputs(Hints(hints), PATHS, SHAPES, MESH)
    for w in words:
        assert w in str(info.value)


def test_a_split_over_two_axes_that_divides():
    fixed = fixed_inputs(Hints({"0/params/Dense_0/bias": P(("data", "model"))}), PATHS, SHAPES,
                         MESH)
    assert fixed == {1: ShardSpec((("data", "model"),))}


def test_logical_rules_as_flax():
    assert logical_to_mesh(("embed", "mlp"), RULES, MESH) == P(None, "model")
    assert logical_to_mesh(("batch", "length", "embed"), RULES, MESH) == P("data", None, None)
    # a mesh axis is used once: the second "mlp" dimension finds its axis taken
    assert logical_to_mesh(("mlp", "mlp2"), RULES + [("mlp2", "model")], MESH) == P("model", None)
    # the first rule of a name whose axes are free wins
    rules = [("heads", "model"), ("kv", "model"), ("kv", "data")]
    assert logical_to_mesh(("heads", "kv"), rules, MESH) == P("model", "data")
    # names that are mesh axes stand for themselves (nn.with_partitioning)
    assert logical_to_mesh((None, "model"), (), MESH) == P(None, "model")


def test_logical_specs_mirror_into_optimizer_state():
    specs = {"params": {"Dense_0": {"kernel": P("embed", "mlp"), "bias": P()}}}
    hints = Hints(logical_axis_rules=RULES, logical_specs=specs)
    paths = ["0/params/Dense_0/kernel", "0/params/Dense_0/bias", "1/0/count",
             "1/0/mu/params/Dense_0/kernel", "1/0/nu/params/Dense_0/kernel"]
    shapes = [(32, 64), (64,), (), (32, 64), (32, 64)]
    fixed = fixed_inputs(hints, paths, shapes, MESH)
    want = ShardSpec(((), ("model",)))
    assert fixed == {0: want, 3: want, 4: want}  # the bias (no names) is left to the planner


def test_a_pinned_logical_name_goes_through_the_rules():
    hints = Hints({"2/**": P("batch")}, logical_axis_rules=RULES)
    fixed = fixed_inputs(hints, PATHS, SHAPES, MESH)
    assert fixed == {3: ShardSpec((("data",), ())), 4: ShardSpec((("data",), ()))}


def test_hints_and_pipelines():
    with pytest.raises(ValueError, match="pipeline=False"):
        SearchOptions(hints={"**": P()}, pipeline=True)


# -- a linen MLP whose kernels carry logical names ---------------------------------------

def _kernel(names):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(64, kernel_init=_kernel(("embed", "mlp")))(x))
        return nn.Dense(32, kernel_init=_kernel(("mlp", "embed")))(h)


def _problem():
    model, opt = MLP(), optax.adam(1e-2)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
    params = model.init(jax.random.key(0), x)  # {"params": ...} holding LogicallyPartitioned

    def step(params, opt_state, batch):
        def loss_fn(p):
            out = model.apply(p, batch[0])
            return jnp.mean((out - batch[1]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, opt.init(params), (x, y))


def _same_as_single_device(planned, step, args, steps=2):
    single = jax.jit(step)
    a = b = args
    for _ in range(steps):
        out_p, out_s = planned(*a), single(*b)
        for x, y in zip(jax.tree.leaves(out_p), jax.tree.leaves(out_s)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
        a, b = (*out_p[:2], args[2]), (*out_s[:2], args[2])


def test_linen_logical_partitioning_pins_the_kernels(mesh2x4):
    step, args = _problem()
    assert isinstance(args[0]["params"]["Dense_0"]["kernel"], nn.LogicallyPartitioned)
    hints = shardplan.Hints({"2/**": P("batch")}, logical_axis_rules=RULES)
    planned = shardplan.auto(step, mesh=mesh2x4, hints=hints, time_limit=10, deterministic=True)
    plan = planned.plan(*args)
    specs = plan.in_specs
    for arg in ("[0]", "[1][0].mu", "[1][0].nu"):
        assert specs[f"{arg}['params']['Dense_0']['kernel'].value"] == P(None, "model")
        assert specs[f"{arg}['params']['Dense_1']['kernel'].value"] == P("model")
    assert specs["[2][0]"] == P("data") and specs["[2][1]"] == P("data")
    # the outputs that carry the state back keep the pinned specs
    assert plan.out_specs["[0]['params']['Dense_0']['kernel'].value"] == P(None, "model")
    _same_as_single_device(planned, step, args)


def test_logical_specs_of_unboxed_params(mesh2x4):
    step, args = _problem()
    specs = nn.get_partition_spec(args[0])
    params = nn.meta.unbox(args[0])
    opt_state = optax.adam(1e-2).init(params)
    hints = shardplan.Hints(logical_axis_rules=RULES, logical_specs=specs)
    plan = shardplan.search(step, params, opt_state, args[2], mesh_shape=(2, 4),
                            axis_names=("data", "model"), hints=hints, time_limit=10,
                            deterministic=True)
    for arg in ("[0]", "[1][0].mu", "[1][0].nu"):
        assert plan.in_specs[f"{arg}['params']['Dense_0']['kernel']"] == P(None, "model")
        assert plan.in_specs[f"{arg}['params']['Dense_1']['kernel']"] == P("model")


def test_a_pattern_puts_the_batch_on_data(mesh2x4):
    step, args = _problem()
    args = (nn.meta.unbox(args[0]), optax.adam(1e-2).init(nn.meta.unbox(args[0])), args[2])
    planned = shardplan.auto(step, mesh=mesh2x4, hints={"2/**": P("data")}, time_limit=10,
                             deterministic=True)
    plan = planned.plan(*args)
    assert plan.in_specs["[2][0]"] == P("data") and plan.in_specs["[2][1]"] == P("data")
    _same_as_single_device(planned, step, args, steps=1)


def test_a_typo_in_a_hint_is_an_error(mesh2x4):
    step, args = _problem()
    planned = shardplan.auto(step, mesh=mesh2x4, hints={"0/params/Dense_0/kernal": P()})
    with pytest.raises(ValueError, match="kernal"):
        planned.plan(*args)


def test_nnx_with_partitioning_names():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
            self.up = nnx.Linear(32, 64, kernel_init=init, rngs=rngs)
            self.down = nnx.Linear(64, 32, rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    with nnx.use_eager_sharding(False):  # names without a mesh to place them on
        graphdef, state = nnx.split(Net(nnx.Rngs(0)))

    def step(state, x):
        loss, grads = jax.value_and_grad(
            lambda s: jnp.mean(nnx.merge(graphdef, s)(x) ** 2))(state)
        return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads), loss

    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    plan = shardplan.search(step, state, x, mesh_shape=(2, 4), axis_names=("data", "model"),
                            hints=shardplan.Hints(logical_axis_rules=RULES), time_limit=10,
                            deterministic=True)
    assert plan.in_specs["[0]['up']['kernel'].value"] == P(None, "model")
    assert plan.out_specs["[0]['up']['kernel'].value"] == P(None, "model")
    assert any(n.startswith("hints pinned 1 of") for n in plan.notes)
