"""Submesh shapes a pipeline stage may run on, and their placement on the cluster.

Alpa (Zheng et al., OSDI 2022, section 5.1) restricts a stage's submesh to a slice of one
host, (1, 2^k), or to whole hosts, (n, devices_per_host). With a power-of-two number of
devices per host, any such shapes whose sizes add up to the cluster tile it exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

STAGE_AXES = ("host", "device")
"""The axes of a stage's submesh: hosts x devices per host."""


def submesh_shapes(num_hosts: int, devices_per_host: int) -> list[tuple[int, int]]:
    """Alpa's candidate submesh shapes, smallest first: (1, 1), (1, 2), (1, 4), ... up to
    devices_per_host, then (n, devices_per_host) for n = 1 .. num_hosts (without repeats)."""
    _check_cluster(num_hosts, devices_per_host)
    shapes = []
    k = 1
    while k <= devices_per_host:
        shapes.append((1, k))
        k *= 2
    for n in range(1, num_hosts + 1):
        if (n, devices_per_host) not in shapes:
            shapes.append((n, devices_per_host))
    return shapes


def assign_submeshes(
    shapes_in_order: Sequence[tuple[int, int]], num_hosts: int, devices_per_host: int
) -> list[tuple[int, ...]]:
    """Device ids (row-major, host * devices_per_host + d) of each shape, in the given order.

    Every shape gets a contiguous block: one host's consecutive devices for (1, k), whole
    consecutive hosts for (n, devices_per_host). The shapes must cover the cluster exactly.
    Stages are first laid out in order (neighbouring stages on neighbouring devices); if that
    leaves gaps, the larger shapes are placed first, which always tiles when devices_per_host
    and the single-host widths are powers of two (Alpa's theorem).
    """
    _check_cluster(num_hosts, devices_per_host)
    shapes = [tuple(int(x) for x in s) for s in shapes_in_order]
    for i, s in enumerate(shapes):
        if len(s) != 2 or s[0] < 1 or s[1] < 1:
            raise ValueError(
                f"submesh {i} has shape {s}; a shape is (hosts, devices) of positive ints"
            )
        n, m = s
        if not (n == 1 and m <= devices_per_host or m == devices_per_host and n <= num_hosts):
            raise ValueError(
                f"submesh {i} has shape {s}, which is neither (1, k <= {devices_per_host}) nor "
                f"(n <= {num_hosts}, {devices_per_host}); use shapes from submesh_shapes()"
            )
    total = num_hosts * devices_per_host
    used = sum(n * m for n, m in shapes)
    if used != total:
        raise ValueError(
            f"submeshes {shapes} hold {used} devices but the cluster has {total} "
            f"({num_hosts} hosts x {devices_per_host}); their sizes must add up to the cluster"
        )
    placed = _place_in_order(shapes, devices_per_host)
    if placed is None:
        order = sorted(range(len(shapes)), key=lambda i: (-shapes[i][0], -shapes[i][1], i))
        by_size = _place_first_fit([shapes[i] for i in order], num_hosts, devices_per_host)
        if by_size is None:
            raise ValueError(
                f"submeshes {shapes} cannot tile {num_hosts} hosts x {devices_per_host} devices "
                "with contiguous blocks; use power-of-two widths within a host"
            )
        placed = [()] * len(shapes)
        for i, ids in zip(order, by_size):
            placed[i] = ids
    return placed


def _check_cluster(num_hosts: int, devices_per_host: int) -> None:
    if num_hosts < 1 or devices_per_host < 1:
        raise ValueError(
            f"cluster of {num_hosts} hosts x {devices_per_host} devices: both must be >= 1"
        )


def _block(host: int, offset: int, shape: tuple[int, int], per_host: int) -> tuple[int, ...]:
    n, m = shape
    return tuple((host + h) * per_host + offset + d for h in range(n) for d in range(m))


def _place_in_order(
    shapes: list[tuple[int, int]], per_host: int
) -> list[tuple[int, ...]] | None:
    """Lay the shapes one after another in device order; None if one would straddle hosts."""
    out = []
    cursor = 0
    for n, m in shapes:
        host, offset = divmod(cursor, per_host)
        if n > 1 and offset != 0 or offset + m > per_host:
            return None
        out.append(_block(host, offset, (n, m), per_host))
        cursor += n * m
    return out


def _place_first_fit(
    shapes: list[tuple[int, int]], num_hosts: int, per_host: int
) -> list[tuple[int, ...]] | None:
    """Whole-host shapes on the first free hosts, then each slice at the first free run of
    one host that fits it; None if a shape finds no room."""
    free = [[True] * per_host for _ in range(num_hosts)]
    out = []
    for n, m in shapes:
        spot = None
        for host in range(num_hosts - n + 1):
            for offset in range(per_host - m + 1):
                if all(free[host + h][offset + d] for h in range(n) for d in range(m)):
                    spot = (host, offset)
                    break
            if spot is not None:
                break
        if spot is None:
            return None
        host, offset = spot
        for h in range(n):
            for d in range(m):
                free[host + h][offset + d] = False
        out.append(_block(host, offset, (n, m), per_host))
    return out
