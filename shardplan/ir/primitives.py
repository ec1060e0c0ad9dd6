"""What is known about each JAX primitive, in one table keyed by primitive name: the strategy
rule family that shards it, its flops, whether XLA fuses it, whether its sharding choice
leads, and which operands a partial sum may pass through.

Adding an operator: one entry here and, for a new family, one rule in shardplan/strategies/
(registered in its module's `rules()`). Primitives the table does not know run replicated
and are reported (see `info`).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

from shardplan.ir import flops as F


@dataclasses.dataclass(frozen=True)
class PrimitiveInfo:
    """What the planner knows of one primitive."""

    family: str
    """The strategy rule family (a key of strategies.registry.RULES). "replicated" (unknown
    primitives), "control" (scan, while, cond, shard_map) and "call" (inlined by the lifter)
    have no rule: their nodes run replicated and are reported."""
    flops: F.FlopsRule | None = F.elementwise
    """(in_shapes, out_shapes, params) -> flops, as XLA's cost analysis counts them; None:
    the flops of its sub-jaxprs, which the lifter adds up."""
    transcendental: bool = False
    """XLA counts transcendental evaluations apart from flops (exp is 0 flops + 1)."""
    fusible: bool = False
    """XLA fuses it into loop or input fusions: only what crosses the fusion's edge is
    written to or read from memory."""
    leader: bool = False
    """Its sharding choice matters on its own: never merged into its operand's as a follower."""
    linear: tuple[int, ...] = ()
    """Operands it is linear in, each alone with the others whole: a partial sum there
    passes to the output. Only where the partitioner keeps it partial: add is linear in
    both together, but XLA reduces each operand before the add
    (tests/test_strategies_elementwise.py::test_partial_sums_pass_only_through_linear_ops)."""
    duplicated: bool = False
    """XLA's fusion duplicates it into every consumer (InstructionFusion: not IsExpensive):
    a result of one that only fused ops read is never written where it is effectively unary
    (intra/memory/liveness.py)."""
    reduction: bool = False
    """It reduces an operand over dimensions (a sum, max, argmax...): whether XLA fuses its
    operand's producer into it depends on the compiler (intra/memory/compilers.py)."""
    reduced_whole: bool = False
    """XLA reduces its partial sums whole, in the layout it made them, before slicing them for
    a reader that splits them further: the slice cannot move into the op (BERT's tied embedding
    gradient on 2x4, a scatter-add's [256, 64] all-reduced whole over `model` and then sliced on
    `data`, where a dot's or a reduction's result is sliced first; intra/reshard_prices.py)."""
    call: str = ""
    """For the "call" family, how the interpreter (ir/interpret.py) runs its body when it runs
    the step equation by equation: "inline" (its equations in place), "checkpoint" (inside
    jax.checkpoint with the equation's policy) or "whole" (bound as it is: its derivative rule
    is its own, as custom_jvp/vjp calls'). The lifter inlines every call (ir/lift.py)."""
    why: str = ""
    """Why a primitive of the "replicated" family runs whole on every device on purpose (empty
    for primitives the table does not know: those are reported as unintended)."""


def _table(family: str, names: str, **fields) -> dict[str, PrimitiveInfo]:
    return {n: PrimitiveInfo(family, **fields) for n in names.split()}


def _each(family: str, flops_of: dict[str, F.FlopsRule], **fields) -> dict[str, PrimitiveInfo]:
    return {n: PrimitiveInfo(family, f, **fields) for n, f in flops_of.items()}


# Elementwise ops JAX lowers to one HLO op each: one flop per element. (bitcast_convert_type
# is elementwise between dtypes of one size; others change the shape and run replicated.)
_ARITHMETIC = """
    abs add add_any and ceil clamp clz complex convert_element_type div eq floor ge gt imag
    is_finite le lt max min mul mulhi ne neg not or population_count real reduce_precision rem
    round select_n shift_left shift_right_arithmetic shift_right_logical sign square sub xor
    bitcast_convert_type eq_to le_to lt_to
"""
# One transcendental evaluation each, no flops.
_TRANSCENDENTAL = "exp log log1p expm1 tanh sqrt rsqrt cbrt pow erf sin cos tan atan atan2"
# Ops JAX expands (through CHLO) into several: flops per element measured on XLA CPU, f32.
_EXPANDED_TRANSCENDENTAL = {
    "exp2": 1, "logistic": 3, "acos": 3, "cosh": 3, "asin": 5, "atanh": 6, "acosh": 7,
    "sinh": 10, "asinh": 11, "erf_inv": 37, "lgamma": 52, "erfc": 60, "digamma": 73,
    "bessel_i0e": 83, "bessel_i1e": 83, "zeta": 122, "polygamma": 254, "igamma": 268,
    "igammac": 268, "igamma_grad_a": 539, "log2": 1,
}
_EXPANDED = {"conj": 4, "nextafter": 23, "one_minus_square": 3}
# Linear in operand k alone: a partial sum there passes through (see PrimitiveInfo.linear).
_LINEAR = {"neg": (0,), "copy": (0,), "name": (0,), "convert_element_type": (0,), "real": (0,),
           "imag": (0,), "conj": (0,), "mul": (0, 1), "div": (0,)}

_ELEMENTWISE = {
    **_table("elementwise", _ARITHMETIC, fusible=True),
    **_table("elementwise", _TRANSCENDENTAL, flops=F.zero, transcendental=True, fusible=True),
    **_each("elementwise", {n: F.per_element(k) for n, k in _EXPANDED_TRANSCENDENTAL.items()},
            transcendental=True, fusible=True),
    **_each("elementwise", {n: F.per_element(k) for n, k in _EXPANDED.items()}, fusible=True),
    # Not lowered to a flop: copies, and identities whose own sharding or layout the plan
    # replaces. `name` is checkpoint_name: a remat policy reads it, the program does not
    # (tests/test_ir_primitives.py::test_checkpoint_name_plans_as_without).
    **_table("elementwise", """copy stop_gradient sharding_constraint reshard name
             layout_constraint relayout xla_metadata_value""", flops=F.zero, fusible=True),
    "integer_pow": PrimitiveInfo("elementwise", F.integer_pow, fusible=True),
    # Horner's rule: a multiply and an add per coefficient past the first, per element.
    "polynomial": PrimitiveInfo("elementwise", F.polynomial, fusible=True),
    # Expanded by JAX into many ops, priced at one flop per element (not matched to XLA's).
    **_table("elementwise", "regularized_incomplete_beta", fusible=True),
}
_ELEMENTWISE = {n: dataclasses.replace(i, linear=_LINEAR.get(n, ())) for n, i in
                _ELEMENTWISE.items()}

_REDUCTIONS = {
    "reduce_sum": PrimitiveInfo("reduce_sum", F.reduction, fusible=True, linear=(0,)),
    # finished across devices by an all-reduce of the same monoid
    **_table("reduce", "reduce_max reduce_min reduce_prod reduce_and reduce_or",
             flops=F.reduction, fusible=True),
    **_table("reduce_whole", "argmax argmin", flops=F.arg_reduction, fusible=True),
    "reduce_xor": PrimitiveInfo("reduce_whole", F.reduction),
    # lax.reduce with a combiner of its own (variadic: several operands and their inits)
    "reduce": PrimitiveInfo("reduce_combined", F.combined_reduction),
    "cumsum": PrimitiveInfo("cumulative", F.cumulative(), linear=(0,)),
    **_table("cumulative", "cumprod cummax cummin", flops=F.cumulative()),
    "cumlogsumexp": PrimitiveInfo("cumulative", F.cumulative(8.0), transcendental=True),
}

_SHAPE = {
    **{n: PrimitiveInfo(n, F.zero, fusible=True, linear=(0,)) for n in
       ("transpose", "squeeze", "reshape")},
    "broadcast_in_dim": PrimitiveInfo("broadcast", F.zero, fusible=True, linear=(0,)),
    **{n: PrimitiveInfo(n, F.zero, fusible=True) for n in ("slice", "pad", "rev", "iota")},
    "concatenate": PrimitiveInfo("along_dimension", F.zero, fusible=True),
    "sort": PrimitiveInfo("along_dimension", F.sort),
    **{n: PrimitiveInfo(n, F.zero) for n in ("dynamic_slice", "dynamic_update_slice", "split")},
    # jnp.stack, jnp.tile and lax.unstack (primitives of their own since jax 0.9)
    **{n: PrimitiveInfo(n, F.zero, fusible=True) for n in ("stack", "unstack", "tile")},
    # an uninitialised array (jnp.empty since jax 0.11): each device allocates its own piece
    "empty": PrimitiveInfo("iota", F.zero, fusible=True),
}

_INDEXED = {
    "gather": PrimitiveInfo("gather", F.gather),
    "scatter": PrimitiveInfo("scatter", F.scatter),
    **_table("scatter", "scatter-mul scatter-min scatter-max scatter-sub",
             flops=F.scatter_combine),
    # a sum combiner: updates split by index leave the output a partial sum
    "scatter-add": PrimitiveInfo("scatter_add", F.scatter_combine, reduced_whole=True),
}

_WINDOWED = {
    "conv_general_dilated": PrimitiveInfo("conv", F.conv, leader=True),
    **_table("window", "reduce_window_sum reduce_window_max reduce_window_min reduce_window",
             flops=F.reduce_window),
    "select_and_scatter_add": PrimitiveInfo("window", F.select_and_scatter),
    "select_and_gather_add": PrimitiveInfo("window"),
    # the generic form (its select and scatter are sub-jaxprs): no rule
    "select_and_scatter": PrimitiveInfo("replicated", F.select_and_scatter),
}

# Every device draws the same bits, except random_bits under partitionable threefry.
_RANDOM = {
    **_table("random", "random_wrap random_unwrap", flops=F.zero, fusible=True),
    "random_seed": PrimitiveInfo("random", F.constant(3), fusible=True),
    # (threefry's rounds: a loop of 5 trips on XLA:CPU; cost_analysis() alone says 53)
    "random_fold_in": PrimitiveInfo("random", F.constant(193), fusible=True),
    "random_split": PrimitiveInfo("random", F.random_split, fusible=True),
    "threefry2x32": PrimitiveInfo("random", F.threefry2x32, fusible=True),
    **_table("random", """random_clone random_gamma threefry4x32 philox2x32 philox4x32
             rng_bit_generator rng_uniform iota_2x32_shape""", fusible=True),
    "random_bits": PrimitiveInfo("random_bits", F.random_bits, fusible=True),
}

_OTHER = {
    "dot_general": PrimitiveInfo("dot", F.dot_general, leader=True),
    **_table("identity", "optimization_barrier device_put shard_alike", flops=F.zero,
             fusible=True),
    # Shardy has no sharding rule for these: XLA gathers their operands whatever the plan.
    **_table("unpartitioned", "top_k approx_top_k"),
    # The scalar a scan's transpose starts its zero accumulators from (jax's lax.empty2).
    "empty2": PrimitiveInfo("unpartitioned", F.zero),
    # Loops are inlined by the lifter (their entry and exit: _LOOP below); kept as one node,
    # replicated, only when the lifter is told to keep loops whole; shard_map always.
    **_table("control", "scan while cond shard_map", flops=None),
    # Inlined by the lifter (ir/lift.py CALLS): a node only if a body does not fit. A
    # composite's decomposition and an xla_metadata_call's body are inlined too: the plan runs
    # their equations (the metadata, a scheduling hint, is not re-emitted).
    **_table("call", "jit pjit call closed_call eval_jaxpr composite xla_metadata_call",
             flops=None, call="inline"),
    "remat2": PrimitiveInfo("call", None, call="checkpoint"),  # jax.checkpoint's primitive
    **_table("call", "custom_jvp_call custom_vjp_call custom_vjp_call_jaxpr custom_lin",
             flops=None, call="whole"),
}

# Primitives that run whole on every device on purpose, each group with its reason (coverage
# reports them apart from the primitives the table does not know). Kernel-language primitives
# (Pallas, Mosaic, Triton, thunky) appear only inside a kernel's body, never in a step's graph:
# their entry points are named here. tests/test_ir_primitives.py enumerates JAX's primitives
# and fails on one that is neither here nor above.
_REPLICATED_WHY = {
    "collectives and manual-axis casts: they appear inside shard_map and pmap bodies, which "
    "run as written": """
        all_gather all_gather_done all_gather_invariant all_gather_reduced
        all_gather_reduced_start all_gather_start all_to_all all_to_all_done all_to_all_start
        axis_index pbroadcast pbroadcast_done pbroadcast_dynamic pbroadcast_start pmax pmin
        ppermute ppermute_done ppermute_start precv preduced psend psum psum_done psum_invariant
        psum_invariant_start psum_start ragged_all_to_all reduce_scatter reduce_scatter_done
        reduce_scatter_start unreduced_pmax unreduced_pmin unreduced_psum unreduced_psum_start
        unreduced_reduce_scatter unreduced_reduce_scatter_start pvary reduced_vary_cast
        reduced_vary_cast_p vary_unreduced_cast vary_unreduced_cast_p""",
    "kernels, custom calls and host callbacks: XLA runs them on whole operands": """
        pallas_call core_map tpu_custom_call mosaic_gpu_p ffi_call cudnn_fusion
        dot_product_attention_fwd dot_product_attention_bwd dot_product_attention_fwd_wrapper
        dot_product_attention_bwd_wrapper dot_product_attention_fp8_fwd
        dot_product_attention_fp8_bwd dot_product_attention_fp8_fwd_wrapper
        dot_product_attention_fp8_bwd_wrapper scaled_matmul scaled_matmul_wrapper rnn_fwd
        rnn_bwd pure_callback io_callback debug_callback debug_print buffer_callback
        inspect_sharding call_exported custom_partitioning""",
    "calls kept whole: their bodies run apart from the step (host compute, batching and "
    "derivative rules, effect ordering, fused regions)": """
        compute_on custom_vmap_call linear_call remat_opt call_hi_primitive
        call_hi_primitive_linearized custom_linear_solve program_order fused_call
        custom_jvp_call_jaxpr""",
    "no sharding rule yet: linear algebra, FFT, ragged and scaled contractions, sparse "
    "formats": """
        cholesky cholesky_update eig eigh geqp3 geqrf hessenberg householder_product lu
        lu_pivots_to_permutation ormqr qr schur svd symmetric_product triangular_solve
        tridiagonal tridiagonal_solve fft ragged_dot_general scaled_dot bcoo_dot_general
        bcoo_dot_general_sampled bcoo_extract bcoo_fromdense bcoo_sort_indices
        bcoo_spdot_general bcoo_sum_duplicates bcoo_todense bcoo_transpose bcsr_dot_general
        bcsr_extract bcsr_fromdense bcsr_todense coo_fromdense coo_matmat coo_matvec coo_spmm
        coo_spmv coo_todense csr_fromdense csr_matmat csr_matvec csr_spmm csr_spmv csr_todense
        todense spsolve""",
    "mutable references and boxes: state, not arrays the plan places": """
        get swap addupdate new_ref empty_ref free_ref freeze accum_grad_in_ref run_state
        create_linear broadcast_to pin unpin box_get box_set new_box new_log log_extend
        log_read stage with_memory_space_constraint""",
    "tokens, checks, shape and platform queries, extended dtypes: no array work": """
        after_all create_token check platform_index shape_assertion dim_as_value
        dimension_size unreachable dce_sink zeros_like tie to_edtype from_edtype consume
        assert_consumed_value global_array_to_host_local_array
        host_local_array_to_global_array""",
}
_REPLICATED = {n: PrimitiveInfo("replicated", why=why) for why, names in _REPLICATED_WHY.items()
               for n in names.split()}

# shardplan's own pseudo-primitives: the entry and exit of an inlined loop (ir/lift.py). They
# have no equation and move no data; their rules (strategies/control_flow.py) give the layout
# of a carry, of a stacked input's or output's slices, and of a cond's results.
_LOOP = {
    **_table("loop_same", "loop_carry loop_result cond_merge", flops=F.zero, fusible=True),
    "loop_slice": PrimitiveInfo("loop_slice", F.zero, fusible=True),
    "loop_stack": PrimitiveInfo("loop_stack", F.zero, fusible=True),
}
PSEUDO = frozenset(_LOOP)

# Names of primitives that JAX has since renamed or removed, kept so older versions plan alike.
OLD_NAMES = frozenset({
    "pjit",                   # jit before jax 0.7
    "custom_vjp_call_jaxpr",  # custom_vjp_call before jax 0.6.1
    # gone by jax 0.12 (closed_call and call are eval_jaxpr after 0.11.0)
    "closed_call", "call", "shard_alike", "reduced_vary_cast_p", "vary_unreduced_cast_p",
    "pbroadcast_done", "pbroadcast_start", "psum_start", "unreduced_psum_start",
    "unreduced_reduce_scatter_start", "box_get", "box_set", "new_box", "new_log", "log_extend",
    "log_read", "core_map",
})
# Names of primitives new since jax 0.10.2, kept so the table is the same on every version.
NEW_NAMES = frozenset({
    "one_minus_square", "log2", "polynomial", "relayout", "program_order",  # jax 0.12
    "reduced_vary_cast", "vary_unreduced_cast", "pbroadcast_dynamic", "unreduced_pmax",
    "unreduced_pmin",
})


def _merged(*tables: dict[str, PrimitiveInfo]) -> dict[str, PrimitiveInfo]:
    """One entry per primitive: a name in two tables is an error, not a silent override."""
    out: dict[str, PrimitiveInfo] = {}
    for table in tables:
        for name, entry in table.items():
            if name in out:
                raise ValueError(f"primitive {name!r} has two entries; keep one")
            out[name] = entry
    return dict(sorted(out.items()))


# What XLA's fusion duplicates into every consumer (InstructionFusion: not IsExpensive).
_DUPLICATED = """
    abs add add_any and ceil clamp convert_element_type eq floor ge gt is_finite le lt max min
    mul ne neg not or round select_n shift_left shift_right_arithmetic shift_right_logical sign
    square sub xor bitcast_convert_type copy stop_gradient broadcast_in_dim reshape squeeze
    transpose slice pad rev iota integer_pow
"""
_REDUCING = "reduce_sum reduce_max reduce_min reduce_prod argmax argmin reduce_and reduce_or"


def _marked(table: dict[str, PrimitiveInfo], names: str, **fields) -> dict[str, PrimitiveInfo]:
    """`table` with `fields` set on the entries of `names` (each must have one)."""
    missing = [n for n in names.split() if n not in table]
    if missing:
        raise ValueError(f"primitives {missing} have no entry to mark")
    return {n: dataclasses.replace(i, **fields) if n in names.split() else i
            for n, i in table.items()}


PRIMITIVES: Mapping[str, PrimitiveInfo] = types.MappingProxyType(_marked(_marked(_merged(
    _REPLICATED, _ELEMENTWISE, _REDUCTIONS, _SHAPE, _INDEXED, _WINDOWED, _RANDOM, _OTHER, _LOOP),
    _DUPLICATED, duplicated=True), _REDUCING, reduction=True))

DEFAULT = PrimitiveInfo("replicated", F.elementwise)
"""What the planner assumes of a primitive it does not know: it runs replicated, one flop
per output element, never fused."""

REPLICATED_ON_PURPOSE = frozenset(_REPLICATED)
"""Primitives that run whole on every device by design (each entry's `why` says why)."""


def info(primitive: str) -> PrimitiveInfo:
    """The table's entry for `primitive`, DEFAULT for names it does not know."""
    return PRIMITIVES.get(primitive, DEFAULT)


def flops(primitive: str, in_shapes, out_shapes, params) -> float:
    """Flops of one equation; 0 for primitives whose flops are their sub-jaxprs' (the lifter
    adds those up)."""
    rule = info(primitive).flops
    return 0.0 if rule is None else rule(in_shapes, out_shapes, params)
