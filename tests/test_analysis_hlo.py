"""Collectives, flops and memory read from compiled programs on 8 CPU devices (literal HLO
snippets: test_analysis_hlo_collectives.py)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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
    if axis == "model":  # XLA re-lays the mesh out: the form with device_ids=(iota tile), or
        # (the XLA of jax 0.12) the mesh's axes by name
        text = compiled.as_text()
        assert "device_ids=([2,4]T(1,0))" in text or "replica_groups=mesh[" in text


def test_psum_scatter_is_a_reduce_scatter_of_the_operand(mesh2x4):
    f = shard_map_jit(lambda a: jax.lax.psum_scatter(a, "model", tiled=True),
                      mesh2x4, P("data"), P("data", "model"))
    compiled = f.lower(jnp.ones((8, 16))).compile()
    # shard_map: explicit lists, or (the XLA of jax 0.12) the mesh's axes by name
    text = compiled.as_text()
    assert "replica_groups={{" in text or "replica_groups=mesh[" in text
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


def test_a_sum_sliced_into_a_stacked_scan_output_is_a_reduce_scatter(mesh8):
    """A scan's per-layer partial sum (a weight's gradient) stacked split over the devices:
    XLA:CPU all-reduces it in the loop and fuses the device's slice into the
    dynamic-update-slice that stacks it (the slice's offset hoisted out of the loop): every
    iteration keeps 1/8 of it, a reduce-scatter on GPU/TPU (before, priced as a whole
    all-reduce: the SPMD pipeline's gradients at GPT 6.7B, 2x the bytes)."""
    split_k = NamedSharding(mesh8, P(None, "x"))

    def f(a, bs):
        return jax.lax.scan(lambda c, b: (c, a @ b), 0.0, bs)[1]

    g = jax.jit(f, in_shardings=(split_k, NamedSharding(mesh8, P(None, "x"))),
                out_shardings=NamedSharding(mesh8, P(None, "x")))
    stats = hlo.analyze(g.lower(jnp.ones((64, 128)), jnp.ones((4, 128, 32))).compile())
    op = only(stats.collectives, "all-reduce")
    assert op.in_loop and op.count == 4
    assert op.sliced_nbytes == op.nbytes == 64 * 32 * 4
    assert only(stats.formed().collectives, "reduce-scatter").count == 4


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


def test_cost_analysis_as_dict_list_or_none():
    d = {"flops": 10.0, "bytes accessed": 4.0, "utilization0{}": 1.0}
    assert hlo._cost_numbers(d) == (10.0, 0.0, 4.0)
    assert hlo._cost_numbers([d, {"flops": 1.0, "transcendentals": 2.0}]) == (11.0, 2.0, 4.0)
    assert hlo._cost_numbers(None) == (0.0, 0.0, 0.0)


_SLICED_AT_INDEX_5 = """HloModule m, num_partitions=2

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused (p0: f32[], p1: f32[], p2: f32[], p3: f32[], p4: f32[8,4], p5: u32[]) -> f32[4,4] {
  %p4 = f32[8,4]{1,0} parameter(4)
  ROOT %sl = f32[4,4]{1,0} slice(%p4), slice={[0:4], [0:4]}
}

ENTRY %main (x: f32[8,4], c: f32[]) -> f32[4,4] {
  %x = f32[8,4]{1,0} parameter(0)
  %c = f32[] parameter(1)
  %pid = u32[] partition-id()
  %ar = f32[8,4]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
  ROOT %f = f32[4,4]{1,0} fusion(%c, %c, %c, %c, %ar, /*index=5*/%pid), kind=kLoop, calls=%fused
}
"""


def test_operand_comments_are_not_names():
    """XLA writes `/*index=5*/` before every fifth operand: the partition id a slicing fusion
    reads there still makes its all-reduce a reduce-scatter once formed (gpt2-124m on 2x4:
    11 of 12 such all-reduces were priced whole)."""
    from shardplan.analysis import hlo_collectives, hlo_parse

    module = hlo_parse.parse_module(_SLICED_AT_INDEX_5)
    fusion = module.computations[module.entry][-1]
    names = [o.split()[-1].lstrip("%") for o in hlo_parse.split_top(fusion.operands)]
    assert names == ["c", "c", "c", "c", "ar", "pid"]
    (op,) = hlo_collectives.parse_collectives(_SLICED_AT_INDEX_5, 2)
    assert op.kind == "all-reduce" and op.sliced_nbytes == op.nbytes == 8 * 4 * 4
