"""Pipeline schedules, GPipe and 1F1B: the operations each stage runs, in order, and their
simulation in time (the dispatch order of the runtime, the timeline, the stage DP's memory)."""

from __future__ import annotations

from collections.abc import Sequence

from shardplan.options import BACKWARD_PER_FORWARD, check_schedule


def split_stage_time(total_s: float) -> tuple[float, float]:
    """(forward, backward) seconds of a micro-batch whose forward + backward take total_s."""
    forward = total_s / (1.0 + BACKWARD_PER_FORWARD)
    return forward, BACKWARD_PER_FORWARD * forward


def stage_ops(num_stages: int, num_micro_batches: int, schedule: str) -> list[list[tuple[str, int]]]:
    """Each stage's ("F" | "B", micro-batch) operations in the order it runs them.

    GPipe: every forward, then every backward. 1F1B (PipeDream-flush): stage s runs
    min(S - s - 1, B) forwards, then alternates one forward and one backward, then drains
    the backwards; it keeps at most S - s micro-batches of activations alive.
    """
    S, B = int(num_stages), int(num_micro_batches)
    check_schedule(schedule)
    if S < 1 or B < 1:
        raise ValueError(f"num_stages ({S}) and num_micro_batches ({B}) must be >= 1")
    out = []
    for s in range(S):
        if schedule == "gpipe":
            out.append([("F", m) for m in range(B)] + [("B", m) for m in range(B)])
            continue
        warm = min(S - s - 1, B)
        ops = [("F", m) for m in range(warm)]
        for k in range(B - warm):
            ops += [("F", warm + k), ("B", k)]
        ops += [("B", m) for m in range(B - warm, B)]
        out.append(ops)
    return out


def simulate(num_stages: int, num_micro_batches: int, schedule: str,
             forward_s: Sequence[float], backward_s: Sequence[float]
             ) -> list[tuple[int, str, int, float, float]]:
    """(stage, "F" | "B", micro-batch, start, end) of every operation when each stage runs its
    operations in order and each waits for its inputs: F(s, m) for F(s - 1, m), B(s, m) for
    B(s + 1, m). Sorted by start time (a valid dispatch order)."""
    per_stage = stage_ops(num_stages, num_micro_batches, schedule)
    S = num_stages
    end: dict[tuple[int, str, int], float] = {}
    pos = [0] * S
    free = [0.0] * S
    rows = []
    remaining = sum(len(ops) for ops in per_stage)
    while remaining:
        progressed = False
        for s in range(S):
            while pos[s] < len(per_stage[s]):
                kind, m = per_stage[s][pos[s]]
                dep = (s - 1, "F", m) if kind == "F" else (s + 1, "B", m)
                if kind == "F" and s == 0 or kind == "B" and s == S - 1:
                    dep = None
                if dep is not None and dep not in end:
                    break
                start = max(free[s], end[dep] if dep is not None else 0.0)
                dur = forward_s[s] if kind == "F" else backward_s[s]
                end[(s, kind, m)] = free[s] = start + dur
                rows.append((s, kind, m, start, start + dur))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for the schedules above
            raise RuntimeError("pipeline schedule deadlocks")
    rows.sort(key=lambda r: (r[3], r[0], r[1]))
    return rows


def dispatch_order(num_stages: int, num_micro_batches: int, schedule: str
                   ) -> list[tuple[str, int, int]]:
    """(kind, stage, micro-batch) in the order the host dispatches them: by start time in the
    schedule with a backward taking BACKWARD_PER_FORWARD forwards."""
    rows = simulate(num_stages, num_micro_batches, schedule, [1.0] * num_stages,
                    [BACKWARD_PER_FORWARD] * num_stages)
    return [(k, s, m) for s, k, m, _, _ in rows]


def tick_grid(num_stages: int, num_micro_batches: int, schedule: str,
              kind: str = "mpmd") -> list[list[str]]:
    """What each stage runs at each tick ("F3", "B0", "" idle) when a forward and a backward
    each take one tick. An SPMD pipeline ("spmd", GPipe) runs M + S - 1 forward ticks, stage s
    on micro-batch t - s at tick t, then the same loop backward (JAX's autodiff through it):
    micro-batches in reverse order."""
    S, M = int(num_stages), int(num_micro_batches)
    if kind == "spmd" and schedule == "1f1b":
        # one loop of M + 2S - 2 ticks, each running a forward slot and a backward slot
        def cell(s, t):
            f, b = t - s, t - (2 * S - 2 - s)
            return (f"F{f}" if 0 <= f < M else "") + (f"B{b}" if 0 <= b < M else "")

        return [[cell(s, t) for t in range(M + 2 * S - 2)] for s in range(S)]
    if kind == "spmd":
        T = M + S - 1
        fwd = [[f"F{t - s}" if 0 <= t - s < M else "" for t in range(T)] for s in range(S)]
        bwd = [[f"B{T - 1 - u - s}" if 0 <= T - 1 - u - s < M else "" for u in range(T)]
               for s in range(S)]
        return [f + b for f, b in zip(fwd, bwd)]
    rows = simulate(S, M, schedule, [1.0] * S, [1.0] * S)
    end = round(max(r[4] for r in rows))
    grid = [[""] * end for _ in range(S)]
    for s, k, m, start, _ in rows:
        grid[s][round(start)] = f"{k}{m}"
    return grid


def timeline_text(num_stages: int, num_micro_batches: int, schedule: str,
                  kind: str = "mpmd") -> str:
    """The schedule as a table of ticks (tick_grid) with its bubble: (S - 1) / (M + S - 1) of
    every stage's ticks idle when stages take equal time."""
    S, M = int(num_stages), int(num_micro_batches)
    grid = tick_grid(S, M, schedule, kind)
    ticks = len(grid[0])
    name = "GPipe" if schedule == "gpipe" else "1F1B"
    where = ("SPMD (one program, ppermute between stages)" if kind == "spmd"
             else "MPMD (one program per stage)")
    w = max(3, *(len(c) + 1 for row in grid for c in row))
    both = kind == "spmd" and schedule == "1f1b"
    what = ("a forward slot and a backward slot per stage per tick, on different micro-batches"
            if both else "a forward or a backward of one micro-batch on one stage per tick")
    lines = [f"{name} {where}: {S} stages x {M} micro-batches, {ticks} ticks ({what})",
             "tick    " + "".join(f"{t:>{w}}" for t in range(ticks))]
    lines += [f"stage {s:<2}" + "".join(f"{c or '.':>{w}}" for c in row)
              for s, row in enumerate(grid)]
    if both:
        idle = sum(2 - (c.count("F") + c.count("B")) for row in grid for c in row)
        lines.append(f"bubble: {idle} of {2 * S * ticks} stage-slots idle = "
                     f"{idle / (2 * S * ticks):.1%}; (2S-2)/(M+2S-2) = {2 * S - 2}/"
                     f"{M + 2 * S - 2} = {bubble_fraction(S, M, schedule, kind):.1%}")
    else:
        idle = sum(c == "" for row in grid for c in row)
        lines.append(f"bubble: {idle} of {S * ticks} stage-ticks idle = "
                     f"{idle / (S * ticks):.1%}; (S-1)/(M+S-1) = {S - 1}/{M + S - 1} = "
                     f"{bubble_fraction(S, M, schedule, kind):.1%}")
    return "\n".join(lines)


def bubble_fraction(num_stages: int, num_micro_batches: int, schedule: str,
                    kind: str = "mpmd") -> float:
    """The idle share of a stage's time with equal stages: (S-1)/(M+S-1), GPipe or 1F1B; the
    SPMD 1F1B loop runs a forward and a backward slot every one of its M+2S-2 ticks, idle
    in (2S-2)/(M+2S-2) of them."""
    S, M = int(num_stages), int(num_micro_batches)
    if kind == "spmd" and schedule == "1f1b":
        return (2 * S - 2) / (M + 2 * S - 2)
    return (S - 1) / (M + S - 1)
