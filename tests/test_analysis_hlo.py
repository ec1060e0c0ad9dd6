"""Collectives, flops and memory read from compiled programs on 8 CPU devices, and from
literal HLO snippets of every replica-group form."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.analysis import hlo
from shardplan.strategies.spec import MeshShape


def ids_grid(mesh):
    return np.vectorize(lambda d: d.id)(mesh.devices)


def axis_groups(mesh, axes):
    """The device-id groups of a collective over `axes` of `mesh`, computed from the mesh."""
    grid = ids_grid(mesh)
    names = list(mesh.axis_names)
    keep = [names.index(a) for a in axes]
    rest = [k for k in range(grid.ndim) if k not in keep]
    moved = grid.transpose(rest + keep).reshape(-1, math.prod(grid.shape[k] for k in keep))
    return sorted(tuple(sorted(int(d) for d in g)) for g in moved)


def sorted_groups(op):
    return sorted(tuple(sorted(g)) for g in op.groups)


def shard_map_jit(fn, mesh, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=False))


def only(ops, kind):
    found = [op for op in ops if op.kind == kind]
    assert len(found) == 1, f"expected one {kind}, got {ops}"
    return found[0]


def ring(kind, nbytes, n):
    return {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(kind, (n - 1) / n) * nbytes


# ------------------------------------------------------------------- compiled programs


def test_data_parallel_grad_all_reduce_is_the_weight_bytes(mesh8):
    w, x = jnp.ones((16, 32)), jnp.ones((64, 16))
    step = jax.jit(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w))),
                   in_shardings=(NamedSharding(mesh8, P()), NamedSharding(mesh8, P("x"))))
    compiled = step.lower(w, x).compile()
    assert "replica_groups=mesh[" in compiled.as_text()  # the named-mesh form
    stats = hlo.analyze(compiled)
    op = only(stats.collectives, "all-reduce")
    assert op.nbytes == w.nbytes == 2048
    assert op.groups == (tuple(range(8)),) and op.group_size == 8
    assert op.bytes_sent == pytest.approx(2 * 7 / 8 * w.nbytes)
    assert stats.bytes_sent == pytest.approx(op.bytes_sent)
    assert stats.by_kind() == {"all-reduce": (1, op.bytes_sent)}
    assert not op.in_loop and op.count == 1 and "dot_general" in op.op_name
    assert "all-reduce" in stats.summary()


@pytest.mark.parametrize("axis", ["model", "data"])
def test_2x4_all_reduce_over_one_axis(mesh2x4, axis):
    a, b = jnp.ones((16, 32)), jnp.ones((32, 8))
    f = jax.jit(lambda a, b: a @ b,
                in_shardings=(NamedSharding(mesh2x4, P(None, axis)),
                              NamedSharding(mesh2x4, P(axis, None))),
                out_shardings=NamedSharding(mesh2x4, P()))
    compiled = f.lower(a, b).compile()
    op = only(hlo.analyze(compiled).collectives, "all-reduce")
    n = mesh2x4.shape[axis]
    assert op.group_size == n and len(op.groups) == 8 // n
    assert sorted_groups(op) == axis_groups(mesh2x4, [axis])
    assert op.nbytes == 16 * 8 * 4
    assert hlo.axes_of_group(op.groups, MeshShape.of(mesh2x4), ids_grid(mesh2x4)) == (axis,)
    if axis == "model":  # XLA re-lays the mesh out: the form with device_ids=(iota tile)
        assert "device_ids=([2,4]T(1,0))" in compiled.as_text()


def test_psum_scatter_is_a_reduce_scatter_of_the_operand(mesh2x4):
    f = shard_map_jit(lambda a: jax.lax.psum_scatter(a, "model", tiled=True),
                      mesh2x4, P("data"), P("data", "model"))
    compiled = f.lower(jnp.ones((8, 16))).compile()
    assert "replica_groups={{" in compiled.as_text()  # shard_map: explicit lists
    op = only(hlo.analyze(compiled).collectives, "reduce-scatter")
    per_device_in = 4 * 16 * 4
    assert op.nbytes == per_device_in and op.shapes == ((1, 16),)
    assert op.bytes_sent == pytest.approx(3 / 4 * per_device_in)
    assert sorted_groups(op) == axis_groups(mesh2x4, ["model"])


def test_all_reduce_then_slice_is_a_reduce_scatter_once_formed(mesh8):
    """XLA:CPU compiles "sum, keep my rows" as an all-reduce and a device-indexed slice; what a
    GPU/TPU runs is a reduce-scatter, and formed() says so."""
    a, b = jnp.ones((64, 128)), jnp.ones((128, 32))
    f = jax.jit(lambda a, b: a @ b,
                in_shardings=(NamedSharding(mesh8, P(None, "x")), NamedSharding(mesh8, P("x"))),
                out_shardings=NamedSharding(mesh8, P("x")))
    stats = hlo.analyze(f.lower(a, b).compile())
    op = only(stats.collectives, "all-reduce")
    assert op.nbytes == 64 * 32 * 4 and op.sliced_nbytes == op.nbytes
    scatter = only(stats.formed().collectives, "reduce-scatter")
    assert scatter.nbytes == op.nbytes and scatter.group_size == 8
    assert scatter.bytes_sent == pytest.approx(7 / 8 * op.nbytes)
    assert stats.formed().bytes_sent == pytest.approx(stats.bytes_sent / 2)


@pytest.mark.parametrize("out", [P(("data", "model")), P("model", "data")])
def test_sums_over_two_axes_kept_as_slices_are_reduce_scatters(mesh2x4, out):
    """A gradient partial over both mesh axes, kept sharded over both (FSDP on 2-D): however
    XLA:CPU reduces it (one all-reduce or one per axis), every reduction is a slice kept."""
    both = ("data", "model")
    a, b = jnp.ones((64, 128)), jnp.ones((128, 32))
    f = jax.jit(lambda a, b: a @ b,
                in_shardings=(NamedSharding(mesh2x4, P(None, both)),
                              NamedSharding(mesh2x4, P(both))),
                out_shardings=NamedSharding(mesh2x4, out))
    stats = hlo.analyze(f.lower(a, b).compile())
    reduces = [c for c in stats.collectives if c.kind == "all-reduce"]
    assert reduces and all(c.sliced_nbytes == c.nbytes for c in reduces), reduces
    assert {c.kind for c in stats.formed().collectives} <= {"reduce-scatter", "collective-permute",
                                                            "all-to-all"}


def test_all_reduce_read_whole_stays_an_all_reduce(mesh8):
    a, b = jnp.ones((64, 128)), jnp.ones((128, 32))
    f = jax.jit(lambda a, b: jnp.tanh(a @ b),
                in_shardings=(NamedSharding(mesh8, P(None, "x")), NamedSharding(mesh8, P("x"))),
                out_shardings=NamedSharding(mesh8, P()))
    stats = hlo.analyze(f.lower(a, b).compile())
    assert only(stats.collectives, "all-reduce").sliced_nbytes == 0
    assert stats.formed().collectives == stats.collectives


def test_all_reduces_form_only_their_sliced_parts(mesh8):
    """Two partial sums, one read whole and one sliced (XLA may combine them in a tuple)."""
    a, b, c = jnp.ones((64, 128)), jnp.ones((128, 32)), jnp.ones((128, 16))
    split_k = NamedSharding(mesh8, P(None, "x"))
    rows = NamedSharding(mesh8, P("x"))
    f = jax.jit(lambda a, b, c: (jnp.tanh(a @ b), a @ c), in_shardings=(split_k, rows, rows),
                out_shardings=(NamedSharding(mesh8, P()), rows))
    stats = hlo.analyze(f.lower(a, b, c).compile())
    whole, sliced = 64 * 32 * 4, 64 * 16 * 4
    assert sum(c.nbytes for c in stats.collectives if c.kind == "all-reduce") == whole + sliced
    assert sum(c.sliced_nbytes for c in stats.collectives) == sliced
    formed = stats.formed().by_kind()
    assert formed["reduce-scatter"][1] == pytest.approx(7 / 8 * sliced)
    assert formed["all-reduce"][1] == pytest.approx(2 * 7 / 8 * whole)


def test_bf16_collectives_widened_by_the_cpu_are_sent_as_bf16_once_formed(mesh8):
    """XLA:CPU runs bf16 arithmetic in f32 and sends what it gathers or reduces in f32; a
    GPU/TPU sends bf16: formed() halves those bytes (and reduce-scatters the sliced sum)."""
    rows, rep = NamedSharding(mesh8, P("x")), NamedSharding(mesh8, P())
    a = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((128, 128), jnp.bfloat16)

    def gathered(a, w):
        return jax.lax.with_sharding_constraint(jnp.tanh(a @ w), rep) @ w

    stats = hlo.analyze(jax.jit(gathered, in_shardings=(rows, rep)).lower(a, w).compile())
    op = only(stats.collectives, "all-gather")
    assert op.dtypes == ("float32",) and op.nbytes == 64 * 128 * 4
    assert op.widened_nbytes == op.nbytes
    assert only(stats.formed().collectives, "all-gather").nbytes == 64 * 128 * 2

    split_k = NamedSharding(mesh8, P(None, "x"))
    v = jax.ShapeDtypeStruct((128, 32), jnp.bfloat16)
    for out, kind in ((rep, "all-reduce"), (rows, "reduce-scatter")):
        f = jax.jit(lambda a, v: jnp.tanh(a @ v), in_shardings=(split_k, rows),
                    out_shardings=out)
        stats = hlo.analyze(f.lower(a, v).compile())
        op = only(stats.collectives, "all-reduce")
        assert op.widened_nbytes == op.nbytes == 64 * 32 * 4
        assert only(stats.formed().collectives, kind).nbytes == 64 * 32 * 2


def test_f32_collectives_are_not_widened(mesh8):
    rows, rep = NamedSharding(mesh8, P("x")), NamedSharding(mesh8, P())
    f = jax.jit(lambda a: jax.lax.with_sharding_constraint(jnp.tanh(a), rep) * 2,
                in_shardings=(rows,))
    stats = hlo.analyze(f.lower(jnp.ones((64, 128))).compile())
    assert not only(stats.collectives, "all-gather").widened_nbytes
    assert stats.formed().collectives == stats.collectives


def test_all_gather_counts_the_gathered_result(mesh2x4):
    f = shard_map_jit(lambda a: jax.lax.all_gather(a, "model", tiled=True),
                      mesh2x4, P("data", "model"), P("data"))
    op = only(hlo.analyze(f.lower(jnp.ones((8, 16))).compile()).collectives, "all-gather")
    assert op.shapes == ((16, 4),) and op.nbytes == 16 * 4 * 4
    assert op.bytes_sent == pytest.approx(3 / 4 * op.nbytes)
    assert sorted_groups(op) == axis_groups(mesh2x4, ["model"])


def test_all_to_all_sums_its_operands(mesh2x4):
    f = shard_map_jit(lambda a: jax.lax.all_to_all(a, "model", 0, 1, tiled=True),
                      mesh2x4, P("data", "model"), P("data", "model"))
    op = only(hlo.analyze(f.lower(jnp.ones((8, 16))).compile()).collectives, "all-to-all")
    assert op.nbytes == 4 * 4 * 4  # the whole (4, 4) block each device holds
    assert sum(math.prod(s) * 4 for s in op.shapes) == op.nbytes
    assert op.bytes_sent == pytest.approx(3 / 4 * op.nbytes)
    assert sorted_groups(op) == axis_groups(mesh2x4, ["model"])


def test_ppermute_sends_its_whole_buffer(mesh2x4):
    ring_pairs = [(i, (i + 1) % 4) for i in range(4)]
    f = shard_map_jit(lambda a: jax.lax.ppermute(a, "model", ring_pairs),
                      mesh2x4, P("data", "model"), P("data", "model"))
    compiled = f.lower(jnp.ones((8, 16))).compile()
    assert "source_target_pairs=" in compiled.as_text()
    op = only(hlo.analyze(compiled).collectives, "collective-permute")
    assert op.nbytes == 4 * 4 * 4 and op.bytes_sent == op.nbytes
    assert sorted_groups(op) == axis_groups(mesh2x4, ["model"])


def test_tuple_all_reduce_sums_the_bytes_of_its_operands(mesh2x4):
    f = shard_map_jit(lambda a, b: jax.lax.psum((a, b), "model"), mesh2x4,
                      (P("data", "model"), P("data", "model")), (P("data"), P("data")))
    compiled = f.lower(jnp.ones((8, 16)), jnp.ones((4, 8))).compile()
    op = only(hlo.analyze(compiled).collectives, "all-reduce")
    assert sorted(op.shapes) == [(2, 2), (4, 4)]
    assert op.nbytes == (4 * 4 + 2 * 2) * 4
    assert op.bytes_sent == pytest.approx(2 * 3 / 4 * op.nbytes)


def test_flops_of_a_batch_sharded_matmul_are_an_eighth(mesh8):
    x, w = jnp.ones((256, 64)), jnp.ones((64, 32))
    single = hlo.analyze(jax.jit(jnp.matmul).lower(x, w).compile())
    sharded = hlo.analyze(jax.jit(jnp.matmul, in_shardings=(
        NamedSharding(mesh8, P("x")), NamedSharding(mesh8, P()))).lower(x, w).compile())
    assert single.flops == pytest.approx(2 * 256 * 64 * 32)
    assert sharded.flops == pytest.approx(single.flops / 8)
    assert sharded.collectives == () and single.num_devices == 1 and sharded.num_devices == 8


def test_peak_memory_shrinks_when_the_big_argument_is_sharded(mesh8):
    big = jnp.ones((1024, 256))

    def peak(spec, **kw):
        f = jax.jit(lambda a: a * 2, in_shardings=NamedSharding(mesh8, spec),
                    out_shardings=NamedSharding(mesh8, spec), **kw)
        return hlo.analyze(f.lower(big).compile())

    replicated, sharded, donated = peak(P()), peak(P("x")), peak(P(), donate_argnums=0)
    assert replicated.peak_bytes > 0
    assert replicated.argument_bytes == big.nbytes
    assert sharded.argument_bytes == big.nbytes // 8
    assert sharded.peak_bytes < replicated.peak_bytes
    for s in (replicated, sharded, donated):
        assert s.peak_bytes == s.argument_bytes + s.output_bytes + s.temp_bytes - s.alias_bytes
    assert donated.alias_bytes == big.nbytes and donated.peak_bytes < replicated.peak_bytes


def test_collectives_in_loops_count_per_trip(mesh2x4):
    def scanned(a):
        return jax.lax.scan(lambda c, x: (jax.lax.psum(c * x, "model"), None),
                            a, jnp.arange(3.0))[0]

    def dynamic(a):  # trip count read from the data: unknown to XLA
        return jax.lax.fori_loop(0, a.astype(jnp.int32)[0, 0],
                                 lambda i, c: jax.lax.psum(c, "model") / 4, a)

    stats = hlo.analyze(shard_map_jit(scanned, mesh2x4, P("data", "model"), P("data"))
                        .lower(jnp.ones((8, 8))).compile())
    op = only(stats.collectives, "all-reduce")
    assert op.in_loop and op.count == 3 and op.count_known
    assert stats.bytes_sent == pytest.approx(3 * op.bytes_sent)
    assert stats.by_kind()["all-reduce"][0] == 3
    stats = hlo.analyze(shard_map_jit(dynamic, mesh2x4, P("data", "model"), P("data", "model"))
                        .lower(jnp.ones((8, 8))).compile())
    op = only(stats.collectives, "all-reduce")
    assert op.in_loop and op.count == 1 and not op.count_known
    assert "unknown trip count" in stats.summary()


def _scan_mlp(mesh, x_spec, w1_spec, w2_spec):
    """A scanned two-matmul layer stack: XLA writes iota replica groups in its while body."""

    def loss(p, x):
        def body(c, pp):
            return jnp.tanh(c @ pp["w1"]) @ pp["w2"], None

        return jnp.mean(jax.lax.scan(body, x, p)[0] ** 2)

    p = {"w1": jnp.ones((2, 32, 64)), "w2": jnp.ones((2, 64, 32))}
    shard = {"w1": NamedSharding(mesh, w1_spec), "w2": NamedSharding(mesh, w2_spec)}
    return jax.jit(jax.grad(loss), in_shardings=(shard, NamedSharding(mesh, x_spec))).lower(
        p, jnp.ones((8, 16, 32))).compile()


def test_iota_replica_groups_from_a_real_program(mesh2x4):
    compiled = _scan_mlp(mesh2x4, P("data"), P(None, None, "model"), P(None, "model", None))
    assert "replica_groups=[2,4]<=[8]" in compiled.as_text()
    ops = [op for op in hlo.analyze(compiled).collectives if op.in_loop]
    assert ops and all(op.count == 2 for op in ops)
    for op in ops:
        if op.group_size == 4:
            assert sorted_groups(op) == axis_groups(mesh2x4, ["model"])


def test_transposed_iota_replica_groups_from_a_real_program(mesh2x4):
    compiled = _scan_mlp(mesh2x4, P("data"), P(None, "data", "model"), P(None, "model", "data"))
    text = compiled.as_text()
    assert "<=[2,4]T(1,0)" in text
    line = next(ln for ln in text.splitlines() if "<=[2,4]T(1,0)" in ln)
    name = line.split("=")[0].split()[-1].lstrip("%")
    op = next(op for op in hlo.analyze(compiled).collectives if op.name == name)
    axes = hlo.axes_of_group(op.groups, MeshShape.of(mesh2x4), ids_grid(mesh2x4))
    assert sorted_groups(op) == axis_groups(mesh2x4, list(axes))
    assert axes == ("data",)


def test_sub_axis_replica_groups_from_a_real_program(mesh2x4):
    f = jax.jit(lambda a: a * 2, in_shardings=NamedSharding(mesh2x4, P("data", "model")),
                out_shardings=NamedSharding(mesh2x4, P("model", "data")))
    compiled = f.lower(jnp.ones((16, 32))).compile()
    assert "':(2)2}" in compiled.as_text()  # a sub-axis of an XLA-made mesh axis
    op = only(hlo.analyze(compiled).collectives, "all-to-all")
    assert sorted(d for g in op.groups for d in g) == list(range(8))
    assert op.group_size == 2 and sorted_groups(op) == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_gspmd_and_shardy_give_the_same_collectives(mesh2x4):
    def programs():
        a, b = jnp.ones((16, 32)), jnp.ones((32, 8))
        yield jax.jit(lambda a, b: a @ b,
                      in_shardings=(NamedSharding(mesh2x4, P(None, "model")),
                                    NamedSharding(mesh2x4, P("model", None))),
                      out_shardings=NamedSharding(mesh2x4, P())).lower(a, b).compile()
        yield shard_map_jit(lambda a: jax.lax.psum(a, "data"), mesh2x4,
                            P("data", "model"), P(None, "model")).lower(jnp.ones((8, 8))).compile()

    def summary(compiled):
        return [(op.kind, op.nbytes, sorted_groups(op)) for op in hlo.analyze(compiled).collectives]

    before = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", True)
    try:
        shardy = [summary(c) for c in programs()]
        jax.config.update("jax_use_shardy_partitioner", False)
        gspmd = [summary(c) for c in programs()]
    finally:
        jax.config.update("jax_use_shardy_partitioner", before)
    assert gspmd == shardy
    assert shardy[1][0][2] == axis_groups(mesh2x4, ["data"])


def test_groups_are_device_ids_on_a_permuted_mesh(devices):
    order = [3, 1, 4, 0, 7, 2, 6, 5]
    mesh = Mesh(np.array(devices)[order].reshape(2, 4), ("data", "model"),
                axis_types=(jax.sharding.AxisType.Auto,) * 2)
    f = shard_map_jit(lambda a: jax.lax.psum(a, "model"), mesh, P("data", "model"), P("data"))
    compiled = f.lower(jnp.ones((8, 8))).compile()
    op = only(hlo.analyze(compiled).collectives, "all-reduce")
    assert sorted_groups(op) == [(0, 1, 3, 4), (2, 5, 6, 7)] == axis_groups(mesh, ["model"])
    assert hlo.axes_of_group(op.groups, MeshShape.of(mesh), ids_grid(mesh)) == ("model",)
    logical = only(hlo.parse_collectives(compiled.as_text()), "all-reduce")
    assert logical.groups == ((0, 1, 2, 3), (4, 5, 6, 7))  # HLO ids are positions


# --------------------------------------------------------------------------- snippets


def module(body, header="num_partitions=8", extra=""):
    return (f"HloModule m, {header}\n\n{extra}\n"
            "%add (a: f32[], b: f32[]) -> f32[] {\n"
            "  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n"
            "  ROOT %s = f32[] add(%a, %b)\n}\n\n"
            "ENTRY %main (p: f32[8,4]) -> f32[8,4] {\n"
            "  %p = f32[8,4]{1,0} parameter(0)\n"
            f"{body}\n}}\n")


def one(text, **kw):
    ops = hlo.parse_collectives(text, **kw)
    assert len(ops) == 1, ops
    return ops[0]


@pytest.mark.parametrize("groups, expected", [
    ("{{0,1,2,3},{4,5,6,7}}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("{{0,4},{1,5},{2,6},{3,7}}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("{}", (tuple(range(8)),)),
    ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("[1,8]<=[8]", (tuple(range(8)),)),
    ("mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", (tuple(range(8)),)),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_1','axis_0'}", ((0, 4, 1, 5, 2, 6, 3, 7),)),
    ("mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}",
     ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0':(2)2}",
     ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("mesh['a'=8] {'a':(1)2}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['a'=8] {'a':(1)2,'a':(4)2}", ((0, 1, 4, 5), (2, 3, 6, 7))),
    ("mesh[a=2,b=4] {b}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh['a'=2,'b'=4], device_ids=(7,6,5,4,3,2,1,0) {'b'}", ((7, 6, 5, 4), (3, 2, 1, 0))),
])
def test_replica_group_forms(groups, expected):
    text = module(f"  ROOT %ar = f32[8,4]{{1,0}} all-reduce(%p), channel_id=1, "
                  f"replica_groups={groups}, use_global_device_ids=true, to_apply=%add, "
                  'metadata={op_name="x, y=(z)"}')
    op = one(text)
    assert op.groups == expected and op.group_size == len(expected[0])
    assert op.nbytes == 128 and op.dtypes == ("float32",) and op.op_name == "x, y=(z)"
    assert op.bytes_sent == pytest.approx(ring("all-reduce", 128, op.group_size))


def test_group_modes_without_global_ids():
    cross_replica = module("  ROOT %ar = f32[8,4]{1,0} all-reduce(%p), "
                           "replica_groups={{0,1}}, to_apply=%add",
                           header="replica_count=2, num_partitions=2")
    assert one(cross_replica).groups == ((0, 2), (1, 3))
    both = module("  ROOT %ar = f32[8,4]{1,0} all-reduce(%p), channel_id=1, "
                  "replica_groups={{0},{1}}, to_apply=%add",
                  header="replica_count=2, num_partitions=2")
    assert one(both).groups == ((0, 1), (2, 3))
    a2a = module("  ROOT %x = f32[8,4]{1,0} all-to-all(%p), channel_id=1, "
                 "replica_groups={{0,1}}, dimensions={0}", header="replica_count=2, num_partitions=2")
    assert one(a2a).groups == ((0, 1), (2, 3))
    no_header = module("  ROOT %ar = f32[8,4]{1,0} all-reduce(%p), replica_groups={}, "
                       "to_apply=%add", header="is_scheduled=true")
    assert one(no_header, num_devices=4).groups == ((0, 1, 2, 3),)
    with pytest.raises(ValueError, match="num_devices=4 but the HLO module runs on 8"):
        hlo.parse_collectives(module(""), num_devices=4)


def test_async_pairs_are_counted_once_with_the_done_shape():
    body = """  %ags = (f32[8,4]{1,0}, f32[64,4]{1,0}) all-gather-start(%p), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = f32[64,4]{1,0} all-gather-done(%ags)
  %ars = f32[8,4]{1,0} all-reduce-start(f32[8,4]{1,0} %p), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, to_apply=%add
  %ard = f32[8,4]{1,0} all-reduce-done(f32[8,4]{1,0} %ars)
  %cps = (f32[8,4]{1,0}, f32[8,4]{1,0}, u32[], u32[]) collective-permute-start(%p), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[8,4]{1,0} collective-permute-done(%cps)
  %rss = ((f32[8,4]{1,0}), f32[2,4]{1,0}) async-start(%p), calls=%rs_comp
  %rsd = f32[2,4]{1,0} async-done(%rss), calls=%rs_comp
  ROOT %t = (f32[64,4]{1,0}, f32[8,4]{1,0}) tuple(%agd, %ard)"""
    extra = """%rs_comp (q: f32[8,4]) -> f32[2,4] {
  %q = f32[8,4]{1,0} parameter(0)
  ROOT %rs = f32[2,4]{1,0} reduce-scatter(%q), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}
"""
    ops = hlo.parse_collectives(module(body, extra=extra))
    assert [op.kind for op in ops] == ["all-gather", "all-reduce", "collective-permute",
                                       "reduce-scatter"]
    ag, ar, cp, rs = ops
    assert ag.shapes == ((64, 4),) and ag.nbytes == 1024 and ag.group_size == 8
    assert ar.nbytes == 128 and ar.bytes_sent == pytest.approx(128.0)
    assert cp.shapes == ((8, 4),) and cp.groups == ((0, 1),) and cp.bytes_sent == 128
    assert rs.nbytes == 128 and rs.bytes_sent == pytest.approx(96.0) and rs.name == "rs"


def test_loops_and_branches_count_per_call_site():
    extra = """%inner_body (a: f32[8,4]) -> f32[8,4] {
  %a = f32[8,4]{1,0} parameter(0)
  ROOT %ar = f32[8,4]{1,0} all-reduce(%a), channel_id=1, replica_groups={}, use_global_device_ids=true, to_apply=%add
}
%cond (c: f32[8,4]) -> pred[] {
  %c = f32[8,4]{1,0} parameter(0)
  ROOT %k = pred[] constant(true)
}
%outer_body (o: f32[8,4]) -> f32[8,4] {
  %o = f32[8,4]{1,0} parameter(0)
  ROOT %w = f32[8,4]{1,0} while(%o), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"4"}}
}
%branch (b: f32[8,4]) -> f32[8,4] {
  %b = f32[8,4]{1,0} parameter(0)
  ROOT %ag = f32[8,4]{1,0} all-gather(%b), channel_id=2, replica_groups={{0,1}}, dimensions={0}
}
"""
    body = """  %w0 = f32[8,4]{1,0} while(%p), condition=%cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  %w1 = f32[8,4]{1,0} while(%p), condition=%cond, body=%inner_body
  %w2 = f32[8,4]{1,0} while(%p), condition=%cond, body=%inner_body, backend_config="{\\"known_trip_count\\":{\\"n\\":\\"5\\"}}"
  %i = s32[] constant(0)
  ROOT %br = f32[8,4]{1,0} conditional(%i, %p, %p), branch_computations={%branch, %branch}"""
    ops = hlo.parse_collectives(module(body, extra=extra))
    assert [(op.kind, op.count, op.count_known, op.in_loop) for op in ops] == [
        ("all-reduce", 12, True, True),
        ("all-reduce", 1, False, True),
        ("all-reduce", 5, True, True),
        ("all-gather", 1, True, False),
        ("all-gather", 1, True, False),
    ]


def test_element_types_and_their_bytes():
    body = ("  %c = bf16[8,4]{1,0} convert(%p)\n"
            "  ROOT %ar = (bf16[8,4]{1,0}, f8e4m3fn[3]{0}, pred[2]{0}, s4[3]{0}) all-reduce(%c, "
            "f8e4m3fn[3]{0} %x, pred[2]{0} %y, s4[3]{0} %z), channel_id=1, "
            "replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add")
    op = one(module(body))
    assert op.dtypes == ("bfloat16", "float8_e4m3fn", "bool", "int4")
    assert op.nbytes == 64 + 3 + 2 + 2  # packed 4-bit ints round up to whole bytes


def test_unreadable_input_is_named():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        hlo.parse_collectives("HloModule m\n")
    bad = module("  ROOT %ar = f32[8,4]{1,0} all-reduce(%p), replica_groups=<<0>>, "
                 "to_apply=%add")
    with pytest.raises(ValueError, match="unknown replica group format"):
        hlo.parse_collectives(bad)
    with pytest.raises(ValueError, match="not in the mesh"):
        hlo.parse_collectives(module("  ROOT %ar = f32[8,4]{1,0} all-reduce(%p), channel_id=1, "
                                     "replica_groups=mesh['a'=8] {'b'}, to_apply=%add"))


def test_cost_analysis_as_dict_list_or_none():
    d = {"flops": 10.0, "bytes accessed": 4.0, "utilization0{}": 1.0}
    assert hlo._cost_numbers(d) == (10.0, 0.0, 4.0)
    assert hlo._cost_numbers([d, {"flops": 1.0, "transcendentals": 2.0}]) == (11.0, 2.0, 4.0)
    assert hlo._cost_numbers(None) == (0.0, 0.0, 0.0)


def test_axes_of_group_on_a_2x2x2_mesh():
    shape = MeshShape(("a", "b", "c"), (2, 2, 2))
    grid = np.arange(8).reshape(2, 2, 2)
    assert hlo.axes_of_group([(0, 1), (2, 3), (4, 5), (6, 7)], shape, grid) == ("c",)
    assert hlo.axes_of_group([(0, 2, 4, 6), (1, 3, 5, 7)], shape, grid) == ("a", "b")
    assert hlo.axes_of_group([(i,) for i in range(8)], shape, grid) == ()
    with pytest.raises(ValueError, match="laid out like"):
        hlo.axes_of_group([(0, 1)], shape, grid.reshape(2, 4))


# ------------------------------------------------------------- mesh form, brute force


@st.composite
def mesh_groups_cases(draw):
    sizes = draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=3))
    perm = draw(st.permutations(range(len(sizes))))
    refs = []
    for k, n in enumerate(sizes):
        choice = draw(st.sampled_from(["none", "full", "sub"] if n >= 4 else ["none", "full"]))
        if choice == "full":
            refs.append((k, 1, n))
        elif choice == "sub":
            size = draw(st.sampled_from([s for s in (2, 4) if s < n]))
            pre = draw(st.sampled_from([p for p in (1, 2, 4) if n % (p * size) == 0]))
            refs.append((k, pre, size))
    refs = draw(st.permutations(refs))
    return sizes, list(perm), refs


@settings(max_examples=60, deadline=None)
@given(mesh_groups_cases())
def test_mesh_form_matches_sub_axis_semantics(case):
    """Groups from `mesh[...] {...}` equal those from Shardy's definition of a sub-axis
    `x:(pre)size`: the index (i // (n / (pre * size))) % size of axis x."""
    sizes, perm, refs = case
    names = [f"ax{k}" for k in range(len(sizes))]
    devices = np.arange(math.prod(sizes)).reshape(sizes).transpose(perm).reshape(-1)
    axes = ",".join(f"'{names[k]}'" + (f":({p}){s}" if s != sizes[k] else "")
                    for k, p, s in refs)
    mesh = ",".join(f"'{a}'={n}" for a, n in zip(names, sizes))
    tile = f"[{','.join(map(str, sizes))}]T({','.join(map(str, perm))})"
    text = module("  ROOT %ar = f32[8,4]{1,0} all-reduce(%p), channel_id=1, replica_groups="
                  f"mesh[{mesh}], device_ids=({tile}) {{{axes}}}, use_global_device_ids=true, "
                  "to_apply=%add", header=f"num_partitions={len(devices)}")
    got = sorted(one(text).groups)

    grid = devices.reshape(sizes)
    by_key: dict = {}
    for coord in itertools.product(*(range(n) for n in sizes)):
        key, order = list(coord), []
        for k, pre, size in refs:
            minor = sizes[k] // (pre * size)
            order.append((coord[k] // minor) % size)
            key[k] = (coord[k] // (minor * size), coord[k] % minor)
        by_key.setdefault(tuple(key), []).append((tuple(order), int(grid[coord])))
    want = sorted(tuple(d for _, d in sorted(members)) for members in by_key.values())
    assert got == want
