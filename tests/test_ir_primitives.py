"""The primitive table: its flops match XLA's cost analysis of each primitive compiled alone,
its keys are real primitive names, and it knows every primitive of the zoo's train steps."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import shardplan
from shardplan import _compat, models
from shardplan.analysis import hlo_flops
from shardplan.ir import primitives
from shardplan.ir.lift import LiftOptions, lift

F32 = jnp.float32
X = jax.ShapeDtypeStruct((16, 32), F32)
Y = jax.ShapeDtypeStruct((8, 16, 8), F32)
I32 = jax.ShapeDtypeStruct((16, 32), jnp.int32)
IDX = jax.ShapeDtypeStruct((8, 16, 1), jnp.int32)
TABLE = jax.ShapeDtypeStruct((32, 64), F32)
UPD = jax.ShapeDtypeStruct((8, 16, 64), F32)
KEY = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
_SCATTER = lax.ScatterDimensionNumbers(update_window_dims=(2,), inserted_window_dims=(0,),
                                       scatter_dims_to_operand_dims=(0,))
_GATHER = lax.GatherDimensionNumbers(offset_dims=(2,), collapsed_slice_dims=(0,),
                                     start_index_map=(0,))


def _max_pool(z):
    return lax.reduce_window(z, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")


# (primitive, function, args): the function's jaxpr has an equation of the primitive, which
# is compiled alone. Exact unless a relative tolerance follows.
CASES = [
    ("clamp", lambda a: lax.clamp(0.0, a, 1.0), (X,)),
    ("sort", lambda a: lax.sort(a, dimension=1), (X,)),
    ("sort", lambda a, b: lax.sort((a, b), dimension=0, num_keys=1), (Y, Y)),
    ("reduce_precision", lambda a: lax.reduce_precision(a, 5, 10), (X,)),
    ("cumsum", lambda a: lax.cumsum(a, axis=1), (Y,)),
    ("cumsum", lambda a: lax.cumsum(a), (jax.ShapeDtypeStruct((48,), F32),)),
    ("cumsum", lambda a: lax.cumsum(a), (jax.ShapeDtypeStruct((1000,), F32),)),
    ("cummax", lambda a: lax.cummax(a, axis=0), (Y,)),
    ("cumlogsumexp", lambda a: lax.cumlogsumexp(a, axis=1), (X,)),
    ("reduce_sum", lambda a: jnp.sum(a, axis=(0, 2)), (Y,)),
    ("reduce_max", lambda a: jnp.max(a, axis=1), (X,)),
    ("reduce", lambda a, b: lax.reduce((a, b), (0.0, 1.0),
                                       lambda p, q: (p[0] + q[0], p[1] * q[1]), (1,)), (X, X)),
    ("argmax", lambda a: jnp.argmax(a, axis=2), (Y,)),
    ("add", lambda a, b: a + b, (X, X)),
    ("mul", lambda a, b: a * b, (X, X)),
    ("select_n", lambda p, a, b: lax.select(p, a, b), (jax.ShapeDtypeStruct((16, 32), bool), X, X)),
    ("convert_element_type", lambda a: a.astype(jnp.bfloat16), (X,)),
    ("bitcast_convert_type", lambda a: lax.bitcast_convert_type(a, F32), (I32,)),
    ("shift_right_logical", lambda a: lax.shift_right_logical(a, 3), (I32,)),
    ("real", lax.real, (jax.ShapeDtypeStruct((64,), jnp.complex64),)),
    ("exp", jnp.exp, (X,)),
    ("tanh", jnp.tanh, (X,)),
    ("logistic", jax.nn.sigmoid, (X,)),
    ("exp2", lax.exp2, (X,)),
    ("erf_inv", lax.erf_inv, (X,)),
    ("asinh", lax.asinh, (X,)),
    ("integer_pow", lambda a: lax.integer_pow(a, 7), (X,)),
    ("integer_pow", lambda a: lax.integer_pow(a, -2), (X,)),
    ("integer_pow", lambda a: lax.integer_pow(a, 1), (X,)),
    ("transpose", lambda a: a.T, (X,)),
    ("broadcast_in_dim", lambda a: jnp.broadcast_to(a, (4, 16, 32)), (X,)),
    ("concatenate", lambda a, b: jnp.concatenate([a, b]), (X, X)),
    ("dynamic_update_slice", lambda a, u: lax.dynamic_update_slice(a, u, (2, 0)), (X, X)),
    ("iota", lambda: lax.iota(F32, 64), ()),
    ("gather", lambda t, i: lax.gather(t, i, _GATHER, (1, 64), mode="fill"), (TABLE, IDX)),
    ("gather", lambda t, i: lax.gather(t, i, _GATHER, (1, 64), mode="clip"), (TABLE, IDX)),
    ("scatter-add", lambda t, i, u: lax.scatter_add(t, i, u, _SCATTER, mode="clip"),
     (TABLE, IDX, UPD)),
    ("scatter-mul", lambda t, i, u: lax.scatter_mul(t, i, u, _SCATTER, mode="fill"),
     (TABLE, IDX, UPD)),
    ("scatter", lambda t, i, u: lax.scatter(t, i, u, _SCATTER, mode="fill"), (TABLE, IDX, UPD)),
    ("dot_general", lambda a, b: a @ b.T, (X, X)),
    ("conv_general_dilated", lambda a, w: lax.conv_general_dilated(
        a, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")),
     (jax.ShapeDtypeStruct((2, 9, 9, 4), F32), jax.ShapeDtypeStruct((3, 3, 4, 8), F32))),
    ("reduce_window_max", _max_pool, (jax.ShapeDtypeStruct((8, 8, 8, 8), F32),)),
    ("select_and_scatter_add", jax.grad(lambda z: _max_pool(z).sum()),
     (jax.ShapeDtypeStruct((8, 8, 8, 8), F32),)),
    ("select_and_scatter_add", jax.grad(lambda z: lax.reduce_window(
        z, -jnp.inf, lax.max, (2, 2), (2, 2), "VALID").sum()), (X,)),
    ("random_fold_in", lambda k: jax.random.fold_in(k, 3), (KEY,)),
    ("random_split", lambda k: jax.random.split(k, 4), (KEY,)),
    ("random_bits", lambda k: jax.random.bits(k, (8, 16, 64)), (KEY,), 0.01),
    ("random_bits", lambda k: jax.random.bits(k, (512,)), (KEY,), 0.01),
]
# primitives new in jax 0.12 (tests/test_ir_primitives.py runs on 0.10 and 0.12)
if hasattr(lax, "one_minus_square"):
    CASES += [
        ("one_minus_square", lax.one_minus_square, (X,)),
        ("log2", lax.log2, (X,)),
        ("polynomial", lambda a: lax.polynomial(a, [1.0, 2.0, 3.0]), (X,)),
        ("polynomial", lambda a: lax.polynomial(a, [a, a, a, a, a, 2.0]), (X,)),
    ]


def _equation(name, f, args):
    jaxpr = jax.make_jaxpr(f)(*args).jaxpr
    found = [e for e in _equations(jaxpr) if e.primitive.name == name]
    assert found, f"{name} not in {[e.primitive.name for e in jaxpr.eqns]}"
    return found[0]


def _equations(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for x in v if isinstance(v, (tuple, list)) else (v,):
                if _compat.is_jaxpr(x):
                    yield from _equations(_compat.open_jaxpr(x)[0])


def _compiled_alone(eqn) -> dict:
    """XLA's cost analysis of the equation as its own program, its literals kept constant,
    its loops' flops at their trip counts (as analysis/hlo.py counts them)."""
    lits = {k: a.val for k, a in enumerate(eqn.invars) if isinstance(a, _compat.Literal)}
    args = [jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype)
            for k, a in enumerate(eqn.invars) if k not in lits]

    def alone(*xs):
        it = iter(xs)
        return eqn.primitive.bind(*[lits[k] if k in lits else next(it)
                                    for k in range(len(eqn.invars))], **eqn.params)

    compiled = jax.jit(alone).lower(*args).compile()
    cost = dict(_compat.cost_analysis(compiled))
    # cost_analysis() counts a while body once; the pricer counts its trips (threefry's
    # rounds run in a loop of 5 on XLA:CPU)
    cost["flops"] = cost.get("flops", 0.0) + hlo_flops.loop_extra_flops(compiled.as_text())
    return cost


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_flops_match_xla(case):
    name, f, args, *rel = case
    eqn = _equation(name, f, args)
    cost = _compiled_alone(eqn)
    ours = primitives.flops(name, [tuple(v.aval.shape) for v in eqn.invars],
                            [tuple(v.aval.shape) for v in eqn.outvars], eqn.params)
    assert ours == pytest.approx(cost.get("flops", 0.0), rel=rel[0] if rel else 1e-9)
    assert primitives.info(name).transcendental == (cost.get("transcendentals", 0.0) > 0)


# Imports every module of jax._src, jax.extend and jax.experimental (each that imports
# without an optional dependency) in a fresh interpreter, and prints every Primitive object
# found in a jax module with the modules holding it.
_ENUMERATE = r"""
import importlib, json, pkgutil, sys, warnings
warnings.simplefilter("ignore")
from jax.extend.core import Primitive
for root in ("jax._src", "jax.extend", "jax.experimental"):
    for m in pkgutil.walk_packages(importlib.import_module(root).__path__, root + "."):
        if "jax2tf" in m.name:
            continue
        try:
            importlib.import_module(m.name)
        except Exception:
            pass
found = {}
for name, module in sorted(sys.modules.items()):
    if module is not None and (name == "jax" or name.startswith("jax.")):
        for v in list(vars(module).values()):
            if isinstance(v, Primitive):
                found.setdefault(v.name, set()).add(name)
print(json.dumps({k: sorted(v) for k, v in found.items()}))
"""

# Kernel languages: their primitives exist only inside a kernel's body (a pallas_call, a
# Mosaic or Triton kernel, a thunky program), which a step's graph holds as one opaque node.
_KERNEL_MODULES = re.compile(r"pallas|mosaic|triton|thunky")


@pytest.fixture(scope="module")
def jax_primitives() -> dict[str, list[str]]:
    """Primitive name -> modules holding it, for every primitive of the installed JAX."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _ENUMERATE], capture_output=True, text=True,
                         env=env, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_primitive_of_jax_has_an_entry(jax_primitives):
    """Every primitive of the JAX in use (outside kernel languages) has a rule family in the
    table or is listed as replicated on purpose with a reason: none runs replicated unseen."""
    assert {"dot_general", "name", "optimization_barrier", "sharding_constraint",
            "layout_constraint", "pallas_call", "scan"} <= set(jax_primitives)
    unknown = sorted(p for p, where in jax_primitives.items()
                     if p not in primitives.PRIMITIVES
                     and not all(_KERNEL_MODULES.search(m) for m in where))
    assert not unknown, {p: jax_primitives[p][:2] for p in unknown}
    for p in ("pallas_call", "tpu_custom_call", "ffi_call", "pure_callback"):
        info = primitives.info(p)
        assert p in primitives.REPLICATED_ON_PURPOSE and info.family == "replicated" and info.why


def test_every_key_is_a_primitive_of_jax(jax_primitives):
    real = set(jax_primitives)
    assert {"dot_general", "split", "random_wrap", "scan"} <= real
    unknown = set(primitives.PRIMITIVES) - real
    known = primitives.OLD_NAMES | primitives.NEW_NAMES | primitives.PSEUDO
    assert unknown <= known, sorted(unknown - known)
    # the version lists say which side of jax 0.10 -> 0.12 a name is on
    assert not (primitives.OLD_NAMES & primitives.NEW_NAMES)


def test_sharding_and_layout_primitives_are_identities():
    """Their own placement is what the plan replaces; each keeps its operand's split."""
    for p in ("name", "sharding_constraint", "reshard", "layout_constraint", "relayout",
              "xla_metadata_value", "copy"):
        assert primitives.info(p).family == "elementwise" and primitives.flops(
            p, [(4, 8)], [(4, 8)], {}) == 0.0, p
    for p in ("optimization_barrier", "device_put", "shard_alike"):
        assert primitives.info(p).family == "identity", p


def _transformer_mlp_step(named: bool):
    """Two MLP blocks as MaxText writes them: each activation tagged with checkpoint_name
    (the `name` primitive) when `named`, and a plain SGD update."""
    def block(h, w1, w2):
        a = h @ w1
        a = checkpoint_name(a, "mlpwi") if named else a
        o = jax.nn.gelu(a) @ w2
        return h + (checkpoint_name(o, "mlpwo") if named else o)

    def loss(params, x):
        h = x
        for w1, w2 in params:
            h = block(h, w1, w2)
        return jnp.mean(h ** 2)

    def step(params, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    params = [(jax.ShapeDtypeStruct((256, 1024), F32), jax.ShapeDtypeStruct((1024, 256), F32))
              for _ in range(2)]
    return step, (params, jax.ShapeDtypeStruct((64, 256), F32))


def test_checkpoint_name_plans_as_without():
    """checkpoint_name is an identity to the planner: a step with it has every operator
    covered and plans exactly as the same step without it (no replication, no gathers)."""
    named, args = _transformer_mlp_step(True)
    plain, _ = _transformer_mlp_step(False)
    assert "name" in {e.primitive.name for e in jax.make_jaxpr(named)(*args).jaxpr.eqns}
    assert not shardplan.coverage(named, *args).replicated
    plans = [shardplan.search(f, *args, cluster="cpu", mesh_shape=(2, 4),
                              axis_names=("data", "model")) for f in (named, plain)]
    assert plans[0].input_specs == plans[1].input_specs
    assert plans[0].output_specs == plans[1].output_specs
    assert plans[0].estimate.comm_s == pytest.approx(plans[1].estimate.comm_s)
    assert plans[0].estimate.compute_s == pytest.approx(plans[1].estimate.compute_s)


def test_unknown_primitives_get_the_default():
    info = primitives.info("shardplan_test_unknown")
    assert info == primitives.DEFAULT
    assert info.family == "replicated" and not info.fusible and not info.leader
    assert primitives.flops("shardplan_test_unknown", [(4, 8)], [(4, 8), (2,)], {}) == 34.0


def test_control_flow_counts_its_bodies():
    def f(x):
        return lax.scan(lambda c, r: (c * r + 1.0, None), x[0], x)[0]

    closed = jax.make_jaxpr(f)(X)
    (node,) = lift(closed, options=LiftOptions(loops=False)).nodes[-1:]
    assert node.primitive == "scan" and primitives.info("scan").flops is None
    assert node.flops == 16 * 2 * 32
    assert lift(closed).flops == 16 * 2 * 32  # inlined: the body's nodes run 16 times


@pytest.fixture(scope="module")
def zoo_primitives() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for name in models.list_models():
        step = models.get_model(name, abstract=True)
        for e in _equations(jax.make_jaxpr(step.fn)(*step.args).jaxpr):
            found.setdefault(e.primitive.name, set()).add(name)
    return found


def test_every_primitive_of_the_zoo_has_an_entry(zoo_primitives):
    assert {"dot_general", "conv_general_dilated", "random_bits"} <= set(zoo_primitives)
    missing = {p: sorted(m) for p, m in zoo_primitives.items() if p not in primitives.PRIMITIVES}
    assert not missing, f"no entry in shardplan/ir/primitives.py for {missing}"


def test_the_tables_call_entries_say_how_their_body_runs():
    """The lifter inlines the "call" family; the interpreter enters a call, runs it under
    jax.checkpoint (remat2, jax.checkpoint's primitive) or binds it whole (a custom derivative)
    as the table's `call` says, and no other primitive has a `call`."""
    from shardplan.ir import lift as lift_mod

    for name, entry in primitives.PRIMITIVES.items():
        assert (entry.call in ("inline", "checkpoint", "whole")) == (entry.family == "call"), name
    assert lift_mod.CALLS == {n for n, i in primitives.PRIMITIVES.items() if i.family == "call"}

    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda p, t: (f(p[0]), jnp.cos(p[0]) * t[0]))
    jaxpr = jax.make_jaxpr(lambda x: jax.checkpoint(jnp.tanh)(x) + f(x) + jax.jit(jnp.exp)(x))(
        jnp.ones(3))
    calls = {e.primitive.name: primitives.info(e.primitive.name).call for e in jaxpr.eqns
             if primitives.info(e.primitive.name).family == "call"}
    assert sorted(calls.values()) == ["checkpoint", "inline", "whole"], calls


def test_marked_facts_sit_on_entries_of_the_table():
    """duplicated, reduction and reduced_whole are fields of the entries they describe."""
    assert primitives.info("reduce_sum").reduction and primitives.info("argmax").reduction
    assert not primitives.info("dot_general").reduction
    assert primitives.info("broadcast_in_dim").duplicated and not primitives.info("exp").duplicated
    assert primitives.info("scatter-add").reduced_whole
    with pytest.raises(ValueError, match="no entry to mark"):
        primitives._marked({}, "made_up_primitive", duplicated=True)
