"""What each XLA compiler does to a step's buffers that a list schedule of the jaxpr does not
show: one Rules value per compiler, looked up by the target's backend (HardwareProfile.backend,
passed down as IntraOptions.compiler). The memory model (intra/memory/model.py, liveness.py) reads
the rules; it knows nothing else of the compiler.

XLA:CPU's rules were measured on its live ranges (benchmarks/xla_live.py); the TPU compiler's
on its memory_analysis (benchmarks/memory_tpu.py, tests/test_memory_tpu.py). No GPU compiler
runs here without a GPU (docs/hardware.md): a GPU target keeps XLA:CPU's rules, the ones
measured, and its plans' peaks are checked where they are compiled.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Rules:
    """One compiler's buffer rules (see each field)."""

    name: str
    unfused: frozenset[str]
    """Ops run as loops of their own, never fused into their readers."""
    also_fused: frozenset[str]
    """Ops the primitive table leaves unfused that this compiler fuses into their readers."""
    generators: frozenset[str]
    """Generators whose two 32-bit words per element are both written and kept (the bits are
    their xor, fused into the readers), with counters as large again while they run."""
    reductions_fuse_producers: bool
    """A reduction takes its elementwise producers into its fusion (else their result is
    written and the reduction reads it)."""
    dots_fuse_producers: bool
    """A dot takes its operands' elementwise producers into its fusion (else they are
    written)."""
    output_fusions: bool
    """A value two or more dots read is written, not recomputed in the dots' operand fusions,
    when it is made by a costly op (attention's probabilities: dot_operands.written), or is
    an elementwise value of a dot's output (a bias add and relu or gelu) that a windowed
    einsum reads, its loop's operand, written by the dot's output fusion beside the
    pre-activation (dot_operands.window_operand; windows.operand_copies); and a step's
    input that a windowed einsum contracts over a major dimension is copied for it."""
    recomputes: bool
    """An elementwise value (or a broadcast, reshape, slice, a generator's bits) that several
    fused ops read is recomputed in each, never written, unless a reduction reads it too and
    so does another op of the same pass (the reduction's fusion writes it as a second output;
    one the backward pass alone reads besides is recomputed there: liveness._recomputable);
    else only cheap unary ops are."""
    shared_broadcasts: bool
    """A broadcast that several ops read is written once and kept from its first read to its
    last (else it is fused into each reader, never written)."""
    hoisted_broadcasts: bool
    """A broadcast of what only the step's inputs feed is made before the first layer."""
    hoisted_gathers: bool
    """A step's input resharded for a dot or a gather (a weight all-gathered) is resharded
    before the first layer, else at its reader."""
    reduction_broadcasts: bool
    """A large reduction reads its operands' broadcasts written whole (YNNPACK's)."""
    conv_layout_copies: bool
    """A convolution's operand laid out otherwise than NHWC / HWIO is copied transposed."""
    layout_copies: bool
    """A gathered operand of a dot is copied once more into the layout the dot reads."""
    hoisted_stack_converts: bool
    """A scan's stacked input whose slice the body casts to a narrower float (f32 weights to
    bf16) is cast whole before the loop and the cast held to the last loop slicing it."""
    fused_slices: bool
    """A reshard that only slices a value (each device's part of the new layout lies in its
    part of the old one: no communication) is taken into its reader's fusion, a dot's, a
    reduction's or an elementwise op's, never written (else the slice is a copy)."""
    holds_gradients: bool
    """The gradients a plan reduces are held for one combined all-reduce after the last of
    them (intra/memory/gradient_holds.py), else each is reduced where it is made."""
    small_temps: float
    """Bytes of scalars the temp allocation holds that the model does not list."""
    tiled: bool
    """Arrays are stored in tiles (tiled_bytes): a shard's minor dimension padded to 128
    elements, the one before it to its tile's rows, the two laid out where they pad least;
    the step's inputs and outputs and its temporaries alike. GPT-2 124M on v5e 16x16, its
    sequence split 16 ways, holds each layer's q/k/v for the backward pass as bf16[8, 64, 12,
    3, 64] a chip, no dimension of 128, in 4.5 MiB for 2.25 (benchmarks/tpu_check.py; counted
    dense, the estimate was 0.87 of the heap). Where another layout suits its reader the
    compiler may pad more than the least: an activation its weight gradient's dot contracts
    over the sequence, bf16[8, 64, 768], laid out with the 64 positions minor (2x, not
    modelled)."""

    def value_bytes(self, cost, value, spec) -> float:
        """The bytes per device of `value` laid out as `spec` (cost.value_bytes, tiled)."""
        if not self.tiled or value.ndim == 0:
            return cost.value_bytes(value, spec)
        return tiled_bytes(spec.shard_shape(value.shape, cost.mesh), value.itemsize)


def tiled_bytes(shape, itemsize: int) -> float:
    """The bytes of an array of `shape` in the TPU's tiled layouts: a vector in 512-byte
    granules (T(512)/T(1024)); else the minor dimension padded to 128 elements and the one
    before it to the rows of its tile (2, 4 or 8: T(2,128), T(4,128), T(8,128), each (2,1) for
    16 bits), the two chosen among the array's dimensions where they pad least. The TPU
    compiler lays out a step's arguments so (libtpu 0.0.42.1, v5e): bf16[4,64,2,1024] as
    {3,2,1,0:T(2,128)(2,1)}, bf16[4,64,3,1024] as {3,1,2,0:T(8,128)(2,1)}, f32[1024,5] as
    {0,1:T(8,128)}, bf16[5,7,9] in 10240 bytes, bf16[32,8,4096,2,448] dense as
    {2,4,3,1,0:T(8,128)(2,1)} (tests/test_memory_tpu.py::
    test_arguments_take_the_tiled_layout_that_pads_least). Before, the last two dimensions
    were padded as given, 16 rows for 16 bits: Mixtral's expert weights, bf16[32, 1, 4096, 2,
    14336] a chip, counted 8x (56 GiB for 7)."""
    if not shape:
        return float(itemsize)
    if len(shape) == 1:
        return float(-(-shape[0] * itemsize // 512) * 512)
    total = int(np.prod(shape))
    if total == 0:
        return 0.0
    best = None
    for m, minor in enumerate(shape):
        for s, second in enumerate(shape):
            if s == m or not minor or not second:
                continue
            rows = 2 if second <= 2 else 4 if second <= 4 else 8
            padded = (total // (minor * second) * (-(-second // rows) * rows)
                      * (-(-minor // 128) * 128))
            best = padded if best is None else min(best, padded)
    return float(best * itemsize)


# XLA:CPU (intra/memory/model.py's docstring says what each rule saw on its live ranges). It runs
# threefry as a loop of its own, partitioned as the plan says: the two 32-bit words it draws
# per element are both kept, and the loop's counters are as large again while it runs.
CPU = Rules(
    name="cpu",
    unfused=frozenset({"random_bits", "threefry2x32"}),
    also_fused=frozenset(),
    generators=frozenset({"random_bits"}),
    reductions_fuse_producers=False,
    dots_fuse_producers=False,
    output_fusions=False,
    recomputes=False,
    shared_broadcasts=True,
    hoisted_broadcasts=True,
    hoisted_gathers=True,
    reduction_broadcasts=True,
    conv_layout_copies=True,
    layout_copies=True,
    fused_slices=False,
    hoisted_stack_converts=False,
    holds_gradients=True,
    # the scalars XLA:CPU's temp allocation holds (a partial sum and its all-reduced copy,
    # loop counters, the offsets of 16-byte alignment): 16 bytes measured on a one-op step
    # (tests/test_fuzz_plans.py), kept with room
    small_temps=64.0,
    tiled=False,
)

# The TPU compiler (libtpu): it fuses the generator (threefry is elementwise on an iota), the
# producers of a reduction and of a dot's operands into their readers, and recomputes an
# elementwise value in every fusion that reads it (a GPT's backward pass recomputes its
# dropout masks and the loss's softmax exp from the logits; the attention's exp, which its
# sum and its normalising divide read, is held), but for an activation of a dot's output that
# a windowed einsum reads (the weight gradient's, reduce-scattered over the slice), which the
# dot's output fusion writes beside the pre-activation; it convolves any layout, assigns its operands' layouts in
# place, and reduces each gradient where it is made (an MLP's data-parallel gradients: one
# all-reduce each, none held for the others).
TPU = Rules(
    name="tpu",
    unfused=frozenset(),
    # jnp.split's slices (a Llama's rotary halves of q and k), recomputed from q and k in
    # each reader (tests/test_memory_tpu.py's Llama on v5e 2x4: eight halves, 8 MiB each, were
    # counted written and held to the backward pass)
    also_fused=frozenset({"split"}),
    generators=frozenset(),
    reductions_fuse_producers=True,
    dots_fuse_producers=True,
    # an MLP's relu and a GPT's gelu written beside their pre-activations by the fusion of
    # the dot before them where a windowed einsum reads them (tests/test_memory_tpu.py)
    output_fusions=True,
    recomputes=True,
    shared_broadcasts=False,
    hoisted_broadcasts=False,
    # its latency-hiding scheduler starts each all-gather of a weight a few ops before its
    # reader (GPT-2 124M's searched plan on v5e 4x4: the embedding gathered for the logits,
    # 74 MiB a chip, and each layer's bf16[768, 768] kernel; benchmarks/xla_live.py)
    hoisted_gathers=False,
    reduction_broadcasts=False,
    conv_layout_copies=False,
    layout_copies=False,
    # an MLP's batch split over `data` and read split over the slice by its first dot: the
    # dynamic slice runs inside the dot's fusion (tests/test_memory_tpu.py's MLP, 2-D plan)
    fused_slices=True,
    # Llama2-7B and 70B, layers scanned (benchmarks/tpu_check.py): each f32 stacked weight
    # cast to bf16 whole before the forward scan, held through the backward one
    hoisted_stack_converts=True,
    holds_gradients=False,
    # no scalars past what the model counts (tests/test_memory_tpu.py); the buffers its
    # memory space assignment holds in a core's VMEM, which its heap peak (analysis/hlo.py
    # ProgramStats.peak_bytes, what it refuses programs by) leaves out: fast_memory.py
    small_temps=0.0,
    tiled=True,
)

RULES = {r.name: r for r in (CPU, TPU)}


def rules(compiler: str) -> Rules:
    """The rules of `compiler` (a HardwareProfile.backend); XLA:CPU's for any other (GPU)."""
    return RULES.get(compiler, CPU)
