"""The collectives of synthetic HLO text: every replica group form, async pairs, loops and
branches counted per call site, element types, errors naming the input; the mesh axes a
group spans."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardplan.analysis import hlo_collectives as hlo
from shardplan.strategies.spec import MeshShape
from tests.test_analysis_hlo import ring


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
