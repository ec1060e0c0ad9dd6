"""What a compiled program really does per device: its collectives, flops and memory.

The partitioned HLO (`compiled.as_text()`, parsed by shardplan.analysis.hlo_parse, its
collectives read by shardplan.analysis.hlo_collectives), `compiled.cost_analysis()` and
`compiled.memory_analysis()` are the measurements the cost model is checked against.
`analyze` gathers them into a ProgramStats.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from shardplan.analysis import hlo_bytes, hlo_flops, hlo_parse
from shardplan.analysis.hlo_collectives import (
    KINDS,
    CollectiveOp,
    axes_of_group,
    parse_collectives,
)

__all__ = ["KINDS", "CollectiveOp", "ProgramStats", "analyze", "axes_of_group",
           "parse_collectives"]


@dataclasses.dataclass(frozen=True)
class ProgramStats:
    """Per-device cost of one compiled program.

    flops, transcendentals, bytes_accessed: from `compiled.cost_analysis()` (per device
    after partitioning); flops also count every iteration of the while loops of known trip
    count (cost_analysis() counts a loop body once): loop_flops of them are added
    (shardplan.analysis.hlo_flops). argument/output/temp/alias/generated_code bytes: from
    `compiled.memory_analysis()`. peak_bytes: the bytes a device must hold, which the
    program fits in or not. On XLA:CPU and GPU, argument + output + temp - alias: every live
    buffer at once, counting donated (aliased) buffers once. On TPU, the compiler's own peak
    (`peak_memory_in_bytes`, its buffer assignment's heap): the TPU compiler compiles a
    program whose sum exceeds HBM when that peak does not and refuses past it, and its
    `temp_size_in_bytes` leaves out temporaries its peak holds
    (tests/test_analysis_tpu.py::test_a_tpu_programs_peak_is_the_compilers_heap_peak).
    xla_peak_bytes: XLA's own heap-simulation peak when the runtime reports it, else 0.
    """

    collectives: tuple[CollectiveOp, ...]
    flops: float
    transcendentals: float
    bytes_accessed: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    peak_bytes: int
    generated_code_bytes: int = 0
    xla_peak_bytes: int = 0
    num_devices: int = 1
    loop_flops: float = 0.0
    """Flops of the loops' iterations beyond the first, added to cost_analysis()'s."""
    contraction_bytes: float = 0.0
    """Bytes the dots and convolutions read and write per device (analysis/hlo_bytes.py):
    the memory-bound term of the compute time analysis/price.py charges."""
    io_bytes: float = 0.0
    """Bytes per device of the step's arguments read and results written
    (analysis/hlo_bytes.py io_bytes): charged with the contraction bytes."""
    widened_contraction_bytes: float = 0.0
    """Of contraction_bytes, the f32 buffers that hold 16-bit floats (XLA:CPU computes bf16
    dots in f32: hlo_bytes.contraction_traffic)."""
    platform: str = "cpu"
    """The platform of the devices the program was compiled for ("cpu", "tpu", "gpu")."""
    optimal_seconds: float = 0.0
    """The TPU compiler's own roofline of the program (`cost_analysis()["optimal_seconds"]`;
    0.0 where the compiler gives none, as XLA:CPU): a sum over the top-level instructions of
    max(flops / peak, HBM bytes / HBM bandwidth), nothing overlapped, a collective charged
    the HBM bytes it reads and writes (not its ICI time, whatever its group), a while body
    counted once (test_analysis_tpu.py::test_optimal_seconds_is_a_sum_of_rooflines). The
    compiler charges each "ConcatBitcast" custom call -1 second; they are added back here
    (CONCAT_BITCAST; test_analysis_tpu.py::test_optimal_seconds_has_no_negative_charges)."""

    def formed(self) -> ProgramStats:
        """The program as a GPU or TPU compiler would run it: every "all-reduce, keep a
        slice" a reduce-scatter, bf16 values sent as bf16 (CollectiveOp.formed), and its
        bf16 dots reading and writing 16-bit values (widened_contraction_bytes halved).
        A program such a compiler compiled is already formed: returned as it is."""
        if self.platform != "cpu":
            return self
        ops = tuple(f for c in self.collectives for f in c.formed())
        return dataclasses.replace(
            self, collectives=ops, widened_contraction_bytes=0.0,
            contraction_bytes=self.contraction_bytes - self.widened_contraction_bytes / 2)

    @property
    def bytes_sent(self) -> float:
        """Bytes each device sends per program run, summed over collectives and executions."""
        return float(sum(c.bytes_sent * c.count for c in self.collectives))

    def by_kind(self) -> dict[str, tuple[int, float]]:
        """kind -> (executions, bytes sent per device), kinds sorted by name."""
        out: dict[str, tuple[int, float]] = {}
        for c in self.collectives:
            n, b = out.get(c.kind, (0, 0.0))
            out[c.kind] = (n + c.count, b + c.bytes_sent * c.count)
        return dict(sorted(out.items()))

    def summary(self) -> str:
        mib = 2**20
        lines = [
            (f"ProgramStats over {self.num_devices} device(s), per device: "
             f"{self.flops / 1e9:.4f} GFLOP, {self.transcendentals:.0f} transcendentals, "
             f"{self.bytes_accessed / mib:.2f} MiB accessed"),
            (f"  memory: peak {self.peak_bytes / mib:.2f} MiB "
             f"{'(the TPU compiler heap) from' if self.platform == 'tpu' else '='} argument "
             f"{self.argument_bytes / mib:.2f} + output {self.output_bytes / mib:.2f} + temp "
             f"{self.temp_bytes / mib:.2f} - alias {self.alias_bytes / mib:.2f} MiB"),
            f"  collectives: {len(self.collectives)}, {self.bytes_sent / mib:.3f} MiB sent",
        ]
        for kind, (n, b) in self.by_kind().items():
            lines.append(f"    {kind:<20} x{n:<4} {b / mib:10.3f} MiB")
        if any(not c.count_known for c in self.collectives):
            lines.append("  (some collectives sit in loops of unknown trip count: counted once)")
        return "\n".join(lines)


def _cost_numbers(cost: Any, keys=("flops", "transcendentals", "bytes accessed")
                  ) -> tuple[float, ...]:
    """(flops, transcendentals, bytes accessed), or the `keys` asked for, from
    cost_analysis(): a dict, a list of dicts (one per HLO module, older jax), or None."""
    dicts = [cost] if isinstance(cost, dict) else list(cost or [])
    return tuple(sum(float(d.get(k) or 0.0) for d in dicts) for k in keys)


def _devices(compiled: Any, num_devices: int) -> list | None:
    """The program's devices in device-assignment order (HLO id -> jax.Device)."""
    runtime = getattr(compiled, "runtime_executable", None)
    try:
        devices = getattr(runtime() if runtime else None, "local_devices", list)()
    except Exception:  # noqa: BLE001 - compile-only (TPU topology) programs have no runtime
        devices = []
    if len(devices) == num_devices:
        return list(devices)
    for sharding in jax.tree_util.tree_leaves(
        (compiled.input_shardings, compiled.output_shardings)
    ):
        mesh = getattr(sharding, "mesh", None)
        devices = getattr(mesh, "devices", None)
        if devices is not None and devices.size == num_devices:
            return list(devices.flat)
    return None


# The TPU compiler's cost analysis charges each of these custom calls -1 second (ProgramStats
# .optimal_seconds; tests/test_analysis_tpu.py::test_optimal_seconds_has_no_negative_charges).
CONCAT_BITCAST = 'custom_call_target="ConcatBitcast"'


def analyze(compiled: Any) -> ProgramStats:
    """Collectives, flops and memory per device of a `jax.stages.Compiled`."""
    text = compiled.as_text()
    if not text:
        raise ValueError("compiled.as_text() is empty: pass a jax.stages.Compiled from "
                         "jax.jit(f).lower(*args).compile()")
    parts, reps = hlo_parse.header_counts(text.split("\n", 1)[0])
    n = (parts or 1) * (reps or 1)
    devices = _devices(compiled, n)
    collectives = parse_collectives(
        text, num_devices=n, device_assignment=None if devices is None else [d.id for d in devices]
    )
    cost = compiled.cost_analysis()
    flops, trans, accessed = _cost_numbers(cost)
    (optimal,) = _cost_numbers(cost, ("optimal_seconds",))
    if optimal:
        optimal += text.count(CONCAT_BITCAST)
    extra = hlo_flops.loop_extra_flops(text)
    if not flops and not optimal:
        # XLA:GPU compiled for compile-only devices has no cost analysis: count the HLO
        # (tests/test_gpu_target.py); the loops' iterations are in that count already.
        flops, extra = hlo_flops.program_flops(text), 0.0
    mem = compiled.memory_analysis()
    traffic, widened = hlo_bytes.contraction_traffic(text)

    def field(name: str) -> int:
        return int(getattr(mem, name, 0) or 0)

    arg, out = field("argument_size_in_bytes"), field("output_size_in_bytes")
    temp, alias = field("temp_size_in_bytes"), field("alias_size_in_bytes")
    platform = devices[0].platform if devices else "cpu"
    heap = field("peak_memory_in_bytes")
    peak = heap if platform == "tpu" and heap else arg + out + temp - alias
    return ProgramStats(
        collectives=collectives, flops=flops + extra, transcendentals=trans, bytes_accessed=accessed,
        argument_bytes=arg, output_bytes=out, temp_bytes=temp, alias_bytes=alias,
        peak_bytes=peak,
        generated_code_bytes=field("generated_code_size_in_bytes"),
        xla_peak_bytes=heap, num_devices=n, loop_flops=extra,
        contraction_bytes=traffic, widened_contraction_bytes=widened,
        io_bytes=hlo_bytes.io_bytes(text), optimal_seconds=optimal,
        platform=platform,
    )
