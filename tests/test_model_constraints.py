"""A model's own sharding constraints (issue 32): read as hints (the default), or ignored
(SearchOptions.model_constraints="ignore"); re-placed on the plan's mesh where the model was
built for another (one device); never bound as written; the plan's notes say what was done
with each.

The models are written as MaxText and Gemma write theirs (MaxText itself needs a newer jax):
MaxText's NNX decoder (layers made by nnx.vmap with a "layers" partition name, scanned with
jax.lax.scan over their stacked parameters under jax.checkpoint, `maybe_shard_with_logical`:
a NamedSharding on the model's own mesh from logical axis rules, size-1 axes removed,
`checkpoint_name` on each layer's input, nnx.Param with `sharding=` metadata); Gemma in
linen (nn.scan over nn.remat layers, parameters made with nn.with_logical_partitioning,
`nn.with_logical_constraint` under `nn.logical_axis_rules` and a mesh context); and plain
jax (`jax.lax.with_sharding_constraint` with P.UNCONSTRAINED dimensions, on the user's mesh
and on a 1-device mesh). Steps with jax.value_and_grad and optax.adamw on the 2x4 mesh of
8 CPU devices; numerics against the single-device step, communication against the compiled
program (as tests/test_model_agrees.py compares them)."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardplan
from shardplan import hints as box_hints
from shardplan.cost.hardware import get_profile
from shardplan.intra import hints as hints_mod
from shardplan.ir import constraints as constraints_mod
from shardplan.ir import interpret
from shardplan.ir.lift import lift
from shardplan.ir.trace import trace
from shardplan.options import Hints, SearchOptions
from shardplan.planning import compiled
from shardplan.strategies.spec import MeshShape, ShardSpec

# MaxText's logical axis rules, on the user's (data, model) mesh
RULES = (("activation_batch", "data"), ("activation_length", None),
         ("activation_embed", None), ("activation_mlp", "model"),
         ("activation_heads", "model"), ("activation_kv", None), ("activation_vocab", "model"),
         ("layers", None), ("embed", None), ("mlp", "model"), ("heads", "model"),
         ("kv", None), ("vocab", "model"), ("norm", None))
VOCAB, EMBED, HEADS, HEAD_DIM, MLP, LAYERS, BATCH, SEQ = 256, 64, 4, 16, 128, 2, 8, 16


def logical_to_mesh_axes(names, mesh, rules=RULES):
    """MaxText's sharding.logical_to_mesh_axes: flax's rules, size-1 mesh axes removed."""
    spec = nn.logical_to_mesh_axes(names, rules=rules)
    return P(*[None if e is None or all(mesh.shape[a] == 1 for a in
                                        ((e,) if isinstance(e, str) else e)) else e
               for e in spec])


def maybe_shard_with_logical(x, names, mesh):
    """MaxText's sharding.maybe_shard_with_logical in its Auto shard mode."""
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, logical_to_mesh_axes(names, mesh)))


def _init(rngs, shape, fan_in):
    return jax.random.normal(rngs.params(), shape) / math.sqrt(fan_in)


class RMSNorm(nnx.Module):
    def __init__(self, rngs):
        self.scale = nnx.Param(jnp.ones((EMBED,)), sharding=("norm",))

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale


class Attention(nnx.Module):
    def __init__(self, mesh, rngs):
        self.mesh = mesh
        self.query = nnx.Param(_init(rngs, (EMBED, HEADS, HEAD_DIM), EMBED),
                               sharding=("embed", "heads", "kv"))
        self.key = nnx.Param(_init(rngs, (EMBED, HEADS, HEAD_DIM), EMBED),
                             sharding=("embed", "heads", "kv"))
        self.value = nnx.Param(_init(rngs, (EMBED, HEADS, HEAD_DIM), EMBED),
                               sharding=("embed", "heads", "kv"))
        self.out = nnx.Param(_init(rngs, (HEADS, HEAD_DIM, EMBED), EMBED),
                             sharding=("heads", "kv", "embed"))

    def __call__(self, x):
        names = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
        q = maybe_shard_with_logical(jnp.einsum("bse,ehd->bshd", x, self.query), names,
                                     self.mesh)
        k = maybe_shard_with_logical(jnp.einsum("bse,ehd->bshd", x, self.key), names, self.mesh)
        v = maybe_shard_with_logical(jnp.einsum("bse,ehd->bshd", x, self.value), names,
                                     self.mesh)
        q, k, v = (checkpoint_name(t, n) for t, n in ((q, "query_proj"), (k, "key_proj"),
                                                       (v, "value_proj")))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(HEAD_DIM)
        scores = jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), scores, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
        o = maybe_shard_with_logical(o, names, self.mesh)
        return checkpoint_name(jnp.einsum("bshd,hde->bse", o, self.out), "out_proj")


class MlpBlock(nnx.Module):
    def __init__(self, mesh, rngs):
        self.mesh = mesh
        self.wi_0 = nnx.Param(_init(rngs, (EMBED, MLP), EMBED), sharding=("embed", "mlp"))
        self.wi_1 = nnx.Param(_init(rngs, (EMBED, MLP), EMBED), sharding=("embed", "mlp"))
        self.wo = nnx.Param(_init(rngs, (MLP, EMBED), MLP), sharding=("mlp", "embed"))

    def __call__(self, x):
        h = jax.nn.silu(checkpoint_name(x @ self.wi_0, "mlpwi_0")) * checkpoint_name(
            x @ self.wi_1, "mlpwi_1")
        h = maybe_shard_with_logical(h, ("activation_batch", "activation_length",
                                         "activation_mlp"), self.mesh)
        return checkpoint_name(h @ self.wo, "mlpwo")


class DecoderLayer(nnx.Module):
    """MaxText's Qwen3DecoderLayer (models/qwen3.py), cut down."""

    def __init__(self, mesh, rngs):
        self.mesh = mesh
        self.pre_norm, self.post_norm = RMSNorm(rngs), RMSNorm(rngs)
        self.attention, self.mlp = Attention(mesh, rngs), MlpBlock(mesh, rngs)

    def __call__(self, inputs):
        names = ("activation_batch", "activation_length", "activation_embed")
        inputs = maybe_shard_with_logical(inputs, names, self.mesh)
        inputs = checkpoint_name(inputs, "decoder_layer_input")
        lnx = maybe_shard_with_logical(self.pre_norm(inputs), names, self.mesh)
        attention = maybe_shard_with_logical(self.attention(lnx), names, self.mesh)
        intermediate = inputs + attention
        hidden = maybe_shard_with_logical(self.post_norm(intermediate), names, self.mesh)
        mlp = maybe_shard_with_logical(self.mlp(hidden), names, self.mesh)
        return maybe_shard_with_logical(intermediate + mlp, names, self.mesh)


class Decoder(nnx.Module):
    """MaxText's NNX decoder: layers made by nnx.vmap (their parameters stacked, named
    "layers"), run by jax.lax.scan over the stacked parameters with full remat."""

    def __init__(self, mesh, rngs):
        self.mesh = mesh
        self.embedding = nnx.Param(_init(rngs, (VOCAB, EMBED), 1), sharding=("vocab", "embed"))
        self.layers = nnx.vmap(lambda r: DecoderLayer(mesh, r), in_axes=0, out_axes=0,
                               transform_metadata={nnx.PARTITION_NAME: "layers"})(
            rngs.split(LAYERS))
        self.final_norm = RMSNorm(rngs)
        self.logits = nnx.Param(_init(rngs, (EMBED, VOCAB), EMBED), sharding=("embed", "vocab"))

    def __call__(self, tokens):
        names = ("activation_batch", "activation_length", "activation_embed")
        x = maybe_shard_with_logical(jnp.take(self.embedding[...], tokens, axis=0), names,
                                     self.mesh)
        graphdef, params, rest = nnx.split(self.layers, nnx.Param, ...)

        @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable,
                           prevent_cse=False)
        def layer_fn(carry, layer_params):
            return nnx.merge(graphdef, layer_params, rest)(carry), None

        x, _ = jax.lax.scan(layer_fn, x, params)
        logits = self.final_norm(x) @ self.logits
        return maybe_shard_with_logical(
            logits, ("activation_batch", "activation_length", "activation_vocab"), self.mesh)


def _loss(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _batch():
    k1, k2 = jax.random.split(jax.random.key(1))
    return {"inputs": jax.random.randint(k1, (BATCH, SEQ), 0, VOCAB),
            "targets": jax.random.randint(k2, (BATCH, SEQ), 0, VOCAB)}


@functools.cache
def maxtext_nnx(model_mesh):
    """(step, args) of the NNX decoder built for `model_mesh`: its params are nnx State (the
    Variables keep their `out_sharding` names), updated by optax.adamw. Made once per mesh
    (the tests share it)."""
    with nnx.use_eager_sharding(False):
        model = Decoder(model_mesh, nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adamw(1e-3)

    def step(params, opt_state, batch):
        def loss_fn(params):
            return _loss(nnx.merge(graphdef, params)(batch["inputs"]), batch["targets"])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), _batch())


class GemmaBlock(nn.Module):
    """A Gemma decoder block as MaxText's linen layers write it: parameters made with
    nn.with_logical_partitioning, activations held with nn.with_logical_constraint."""

    @nn.compact
    def __call__(self, x, _):
        def param(name, shape, names, fan_in):
            init = nn.with_logical_partitioning(
                lambda k, s: jax.random.normal(k, s) / math.sqrt(fan_in), names)
            return self.param(name, init, shape)

        names = ("activation_batch", "activation_length", "activation_embed")
        x = nn.with_logical_constraint(x, names)
        x = checkpoint_name(x, "decoder_layer_input")
        scale = param("pre_norm", (EMBED,), ("norm",), 1)
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale
        h = nn.with_logical_constraint(h, names)
        gate = h @ param("gating", (EMBED, MLP), ("embed", "mlp"), EMBED)
        up = h @ param("linear", (EMBED, MLP), ("embed", "mlp"), EMBED)
        act = nn.with_logical_constraint(jax.nn.gelu(gate) * up,
                                         ("activation_batch", "activation_length",
                                          "activation_mlp"))
        out = checkpoint_name(act @ param("wo", (MLP, EMBED), ("mlp", "embed"), MLP), "mlpwo")
        return nn.with_logical_constraint(x + out, names), None


class Gemma(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        emb = self.param("embedding", nn.with_logical_partitioning(
            lambda k, s: jax.random.normal(k, s), ("vocab", "embed")), (VOCAB, EMBED))
        x = jnp.take(emb, tokens, axis=0) * math.sqrt(EMBED)
        x = nn.with_logical_constraint(
            x, ("activation_batch", "activation_length", "activation_embed"))
        layers = nn.scan(nn.remat(GemmaBlock, prevent_cse=False),
                         variable_axes={"params": 0}, split_rngs={"params": True},
                         length=LAYERS, metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = layers(name="layers")(x, None)
        logits = x @ emb.T  # tied embedding, as Gemma
        return nn.with_logical_constraint(
            logits, ("activation_batch", "activation_length", "activation_vocab"))


def gemma_linen():
    """(step, args) of the linen Gemma: plain (unboxed) params; the step must be traced under
    `with jax.set_mesh(mesh), nn.logical_axis_rules(RULES)` for its constraints to exist."""
    model = Gemma()
    batch = _batch()
    params = nn.unbox(model.init(jax.random.key(0), batch["inputs"]))["params"]
    tx = optax.adamw(1e-3)

    def step(params, opt_state, batch):
        def loss_fn(params):
            return _loss(model.apply({"params": params}, batch["inputs"]), batch["targets"])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), batch)


def plain_jax(mesh, one_device):
    """(step, args) of an MLP stack scanned over stacked params with
    jax.lax.with_sharding_constraint: on the user's mesh (an UNCONSTRAINED dimension too) and
    on a mesh of one device."""
    k = jax.random.split(jax.random.key(2), 4)
    params = {"w_in": jax.random.normal(k[0], (LAYERS, EMBED, MLP)) / 8,
              "w_out": jax.random.normal(k[1], (LAYERS, MLP, EMBED)) / 11}
    x = jax.random.normal(k[2], (4 * BATCH, EMBED))
    y = jax.random.normal(k[3], (4 * BATCH, EMBED))
    tx = optax.adamw(1e-3)

    def loss_fn(params, x, y):
        def layer(h, w):
            h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data", None)))
            h = checkpoint_name(h, "layer_input")
            a = jax.lax.with_sharding_constraint(
                jnp.tanh(h @ w["w_in"]), NamedSharding(mesh, P(P.UNCONSTRAINED, "model")))
            return h + jax.lax.with_sharding_constraint(
                a @ w["w_out"], NamedSharding(one_device, P("data", "model"))), None

        h, _ = jax.lax.scan(jax.checkpoint(layer), x, params)
        return jnp.mean((h - y) ** 2)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), x, y)


def _one_device_mesh(names=("data", "model")):
    from jax.sharding import AxisType

    return jax.make_mesh((1,) * len(names), names, devices=jax.devices()[:1],
                         axis_types=(AxisType.Auto,) * len(names))


def _close(a, b, tol=2e-4):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


_REFERENCES: dict = {}  # step -> its results on one device (the MaxText tests share steps)


def _one_device(step, args):
    """The step's results on one device, its jaxpr bound again without the model's
    constraints (they may name devices of two meshes). Once per step."""
    if step not in _REFERENCES:
        _REFERENCES[step] = _run_on_one_device(step, args)
    return _REFERENCES[step]


def _run_on_one_device(step, args):
    traced = trace(step, args)
    graph = lift(traced.closed_jaxpr, traced.arg_info)
    flat = [jax.device_put(x, jax.devices()[0]) for x in jax.tree_util.tree_leaves(args)]
    out = jax.jit(lambda *a: interpret.run(graph, a, identity=constraints_mod.is_constraint))(
        *flat)
    return jax.tree_util.tree_unflatten(traced.out_tree, out)


def _run_and_check(step, args, mesh, want=None, **options):
    """Plan and run `step` on `mesh`; the results equal the single-device step's (`want`,
    default _one_device's); the plan's communication within 10% of the compiled program's.
    Returns the plan."""
    auto = shardplan.auto(step, mesh=mesh, **options)
    plan = auto.plan(*args)
    got = auto(*args)
    _close(got, _one_device(step, args) if want is None else want)
    _, priced = compiled.compile_and_price(auto.lower(*args), mesh, plan.mesh,
                                          get_profile("cpu"), "float32")
    assert plan.estimate.comm_bytes == pytest.approx(priced.bytes_sent, rel=0.10, abs=4096)
    return plan


def _notes(plan) -> str:
    return "\n".join(plan.notes)


def _constraint_specs(step, args, plan, mesh):
    """{node id: the plan's layout of its value} for every model constraint of the step."""
    traced = trace(step, args)
    graph = lift(traced.closed_jaxpr, traced.arg_info)
    found = constraints_mod.of_graph(graph)
    return graph, found, {nid: plan.constraints.get(graph.nodes[nid].outputs[0])
                          for nid in found}


def test_maxtext_built_for_one_device_compiles_on_the_users_mesh(devices, mesh2x4):
    """A MaxText model built for one device names a 1-device mesh in every constraint (every
    spec empty: MaxText drops size-1 axes): bound as written, XLA refuses the program
    ("incompatible devices ... sharding_constraint inside jit with device ids [0]"). Each is
    re-placed on the plan's mesh, where it names no axis: the planner lays the value out."""
    step, args = maxtext_nnx(_one_device_mesh())
    plan = _run_and_check(step, args, mesh2x4)
    notes = _notes(plan)
    assert "model sharding constraints:" in notes
    assert "(1 device)" in notes and "re-placed on the plan's mesh" in notes
    assert "read as a hint" not in notes


def test_maxtext_on_the_users_mesh_holds_its_constraints(devices, mesh2x4):
    """Built for the user's mesh, every constraint is read as a hint: the plan holds each
    value in the layout MaxText's rules give it, and prices the moves (communication within
    10% of the compiled program's)."""
    step, args = maxtext_nnx(mesh2x4)
    plan = _run_and_check(step, args, mesh2x4)
    graph, found, specs = _constraint_specs(step, args, plan, mesh2x4)
    assert len(found) >= 10 * LAYERS
    shape = MeshShape.of(mesh2x4)
    for nid, c in found.items():
        pin = hints_mod.replaced(c, graph.values[graph.nodes[nid].outputs[0]].shape, shape)
        assert specs[nid] == ShardSpec(tuple(() if d is None else d for d in pin)), (
            graph.nodes[nid].name, c.text)
    assert "read as a hint" in _notes(plan) and "re-placed" not in _notes(plan)


@pytest.mark.slow
def test_ignoring_the_models_constraints(devices, mesh2x4):
    """model_constraints="ignore": the planner lays every constrained value out (the notes
    say so); the step still runs equal to one device, its estimate still agrees."""
    step, args = maxtext_nnx(mesh2x4)
    plan = _run_and_check(step, args, mesh2x4, model_constraints="ignore")
    notes = _notes(plan)
    assert "ignored (option model_constraints='ignore')" in notes
    assert "read as a hint" not in notes


def test_gemma_linen_scanned_with_logical_constraints(devices, mesh2x4):
    """Linen layers under nn.scan and nn.remat, nn.with_logical_constraint under the rules
    and the mesh as MaxText's train loop sets them: hints on the user's mesh."""
    step, args = gemma_linen()
    want = jax.jit(step)(*args)  # outside the mesh context: one device, no constraints
    with jax.set_mesh(mesh2x4), nn.logical_axis_rules(RULES):
        plan = _run_and_check(step, args, mesh2x4, want)
        _, found, specs = _constraint_specs(step, args, plan, mesh2x4)
    assert found and all(c is not None for c in found.values())
    batch_split = [nid for nid, c in found.items() if c.dims[0] == ("data",)]
    assert batch_split and all(specs[n].dims[0] == ("data",) for n in batch_split)
    assert "read as a hint" in _notes(plan)


def test_plain_constraints_unconstrained_and_on_one_device(devices, mesh2x4):
    """jax.lax.with_sharding_constraint in a scanned, rematerialized layer: a constraint on
    the user's mesh is held; an UNCONSTRAINED dimension is left to the planner; one on a
    1-device mesh keeps the axes the plan's mesh has by name (P("data", "model") on data=1 x
    model=1 is re-placed as [data,model])."""
    step, args = plain_jax(mesh2x4, _one_device_mesh())
    plan = _run_and_check(step, args, mesh2x4)
    notes = _notes(plan)
    assert "re-placed on the plan's mesh as [data,model], read as a hint" in notes
    assert "read as a hint, [*,model]" in notes and "read as a hint, [data,-]" in notes
    ignored = _run_and_check(step, args, mesh2x4, model_constraints="ignore")
    assert "ignored" in _notes(ignored)


def _constraint(dims, names=("data", "model"), sizes=(2, 4)):
    return constraints_mod.Constraint(dims, names, sizes, (), "P(...)")


def test_replaced_on_the_plans_mesh():
    mesh = MeshShape(("data", "model"), (2, 4))
    # on the plan's mesh: as written, a whole dimension stays whole
    assert hints_mod.replaced(_constraint((("data",), ())), (8, 16), mesh) == (("data",), ())
    # UNCONSTRAINED stays free
    assert hints_mod.replaced(_constraint((None, ("model",))), (8, 16), mesh) == \
        (None, ("model",))
    # from one device: the axes the plan's mesh has by name, whole dimensions free
    one = _constraint((("data",), (), ("model",)), sizes=(1, 1))
    assert hints_mod.replaced(one, (8, 3, 16), mesh) == (("data",), None, ("model",))
    # other axis names (MaxText's fsdp, tensor): nothing of them on this mesh
    other = _constraint((("fsdp",), ("tensor",)), names=("fsdp", "tensor"), sizes=(8, 1))
    assert hints_mod.replaced(other, (8, 16), mesh) == (None, None)
    # an axis that does not divide its dimension is dropped, as MaxText drops it
    assert hints_mod.replaced(_constraint((("data", "model"), ())), (6, 16), mesh) == \
        (("data",), ())


def test_the_option_is_checked_and_box_names_follow_it():
    with pytest.raises(ValueError, match="model_constraints"):
        SearchOptions(model_constraints="drop")
    with nnx.use_eager_sharding(False):
        params = nnx.split(MlpBlock(None, nnx.Rngs(0)), nnx.Param)[1]
    hinted = box_hints.with_boxes(Hints(), (params,))
    assert dict(hinted.logical_names)["0/wi_0"] == ("embed", "mlp")
    assert box_hints.with_boxes(Hints(), (params,), model_constraints="ignore") == Hints()
