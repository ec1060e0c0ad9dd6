"""XLA's live set, from a compile dumped with --xla_dump_to=DIR --xla_dump_hlo_as_text: the bytes
live at each step of its schedule and the buffers live at its peak (or at a step given).

The sizes come from DIR's *buffer-assignment.txt (a loop's results too, listed as "(phi)"
values: without them gpt-6.7b's threefry loops' bits, 3.3 GB, went missing and the heap looked
52% gappy), the intervals from the BufferLiveRange section of *live-range.txt. Its own "Live ranges at N (peak)" is not memory_analysis' peak: on a GPT on 8
devices it listed 1.18 MB where the intervals hold 1.44 MB at the gradients' combined
all-reduce, which memory_analysis() reports (1.45 MB: temp allocation 811464 bytes for 810064
live). The temp allocation exceeds the temporaries' live peak by XLA's heap gaps (0.2-3.6% on
the zoo at test size).

    .venv/bin/python benchmarks/xla_live.py DIR            # the latest module dumped in DIR
    .venv/bin/python benchmarks/xla_live.py DIR --at 988 --top 60
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys

import numpy as np


def read(dump_dir: str):
    """(schedule: step -> instruction, buffers: [(name, bytes, start, end, kind)], temp
    allocation bytes) of the latest module dumped in `dump_dir`."""
    live_file = max(glob.glob(os.path.join(dump_dir, "*live-range.txt")),
                    key=os.path.getmtime)
    base = live_file[: -len("-live-range.txt")]
    size, kind, alloc = {}, {}, ""
    with open(base + "-buffer-assignment.txt") as f:
        assignment = f.read()
    for line in assignment.splitlines():
        m = re.match(r"allocation \d+: size \d+, (.*):", line)
        if m:
            alloc = m.group(1)
            continue
        m = re.match(r" value: <\d+ (\S+)(?: \(\w+\))? @\d+> \(size=(\d+),offset=\d+\)", line)
        if m:
            size[m.group(1)], kind[m.group(1)] = int(m.group(2)), alloc
    temp = re.search(r"allocation \d+: size (\d+), preallocated-temp", assignment)
    with open(live_file) as f:
        text = f.read()
    schedule = {int(m.group(1)): m.group(2)
                for m in re.finditer(r"^    (\d+):(\S+)$", text, re.MULTILINE)}
    ranges = text.split("BufferLiveRange:")[1].split("Live ranges at")[0]
    buffers = []
    for m in re.finditer(r"^    (\S+):(\d+)-(\d+)$", ranges, re.MULTILINE):
        name = m.group(1).removesuffix("{}")
        if name in size:
            buffers.append((name, size[name], int(m.group(2)), int(m.group(3)), kind[name]))
    return schedule, buffers, int(temp.group(1)) if temp else 0


def is_temp(kind: str) -> bool:
    return not any(k in kind for k in ("parameter", "constant", "live-out"))


def curves(schedule, buffers):
    """(all bytes, temporaries' bytes) live at each step."""
    n = max(schedule) + 2
    total, temp = np.zeros(n + 1), np.zeros(n + 1)
    for _, b, s, e, k in buffers:
        total[s] += b
        total[e + 1] -= b
        if is_temp(k):
            temp[s] += b
            temp[e + 1] -= b
    return np.cumsum(total), np.cumsum(temp)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dump_dir")
    parser.add_argument("--at", type=int, help="a step of the schedule (default: the peak)")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--hbm", action="store_true",
                        help="device memory only: leave out the buffers of other memory spaces "
                             "(a TPU's VMEM, its allocations' 'color 1'), which memory_analysis "
                             "does not count")
    args = parser.parse_args(argv)
    schedule, buffers, temp_alloc = read(args.dump_dir)
    if args.hbm:
        buffers = [b for b in buffers if not b[4].startswith("color ")]
    total, temp = curves(schedule, buffers)
    peak = int(temp.argmax())
    print(f"live peak {total.max():.0f} bytes at step {int(total.argmax())}; temporaries "
          f"{temp.max():.0f} live at step {peak} ({schedule.get(peak)}), temp allocation "
          f"{temp_alloc} (heap gaps {temp_alloc / max(temp.max(), 1) - 1:+.1%})")
    at = peak if args.at is None else args.at
    live = sorted(((b, n, s, e) for n, b, s, e, k in buffers if s <= at <= e and is_temp(k)),
                  reverse=True)
    print(f"temporaries live at step {at} ({schedule.get(at)}): {temp[at]:.0f} bytes")
    for b, n, s, e in live[:args.top]:
        print(f"  {b:9d}  {n:40s} [{s}, {e}]  made by {schedule.get(s)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
