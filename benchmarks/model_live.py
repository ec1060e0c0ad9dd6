"""The memory model's live set at its peak, for a zoo model planned as memory_check.py plans it,
beside XLA's (benchmarks/xla_live.py reads the compile this dumps).

Plans MODEL at test size (or --size) on MESH under BUDGET bytes (`shardplan.auto`, as memory_check does),
compiles the plan with --xla_dump_to=DIR, and prints the compiled peak, the model's estimate
and the buffers the model holds at its peak (MemoryModel.live: sizes without the margin),
with the layouts of the values whose copies are among them.

    .venv/bin/python benchmarks/model_live.py gpt 2x4 1560000 /tmp/gpt24 --top 40
    .venv/bin/python benchmarks/xla_live.py /tmp/gpt24 --top 40
    .venv/bin/python benchmarks/model_live.py moe 8 80e9 /tmp/moe8 --size 380m  # 0.917
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np


def live_at_peak(problem, chosen):
    """(moment, [(bytes, start, end, what)] live then, sorted) of the model's peak at `chosen`."""
    model = problem.memory()
    choice = {r: next(k for k, t in enumerate(problem.strategies[r]) if t is chosen[r])
              for r in problem.roots}
    items = model.live(choice)
    change = np.zeros(max(e for _, e, _, _ in items) + 2)
    for s, e, b, _ in items:
        change[s] += b
        change[e + 1] -= b
    t = int(np.cumsum(change).argmax())
    return t, sorted(((b / model.scale if not w.startswith(("input", "output", "small")) else b,
                       s, e, w) for s, e, b, w in items if s <= t <= e), reverse=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("mesh", choices=["8", "2x4"])
    parser.add_argument("budget", type=float)
    parser.add_argument("dump_dir")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--size", help="a zoo size (default: the test size)")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, os.path.dirname(__file__))
    import memory_check

    from shardplan import models
    from shardplan.analysis import hlo
    from shardplan.intra import estimate
    from shardplan.planning import compiled as compiled_mod

    seen = []  # (problem, chosen) of every plan the memory model evaluated: the last is kept
    evaluate = estimate.peak_bytes

    def spy(problem, chosen):
        seen.append((problem, chosen))
        return evaluate(problem, chosen)

    estimate.peak_bytes = spy
    step = models.get_model(args.model, args.size or "tiny", abstract=True)
    auto_step = memory_check._auto(step, memory_check._mesh(args.mesh), int(args.budget))
    plan = auto_step.plan(*step.args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowered = auto_step.lower(*step.args)
    compiled = lowered.compile(compiler_options={
        **compiled_mod.FAST_COMPILE, "xla_dump_to": args.dump_dir, "xla_dump_hlo_as_text": True})
    peak = hlo.analyze(compiled).peak_bytes
    model_peak = (plan.model_estimate or plan.estimate).peak_bytes
    print(f"compiled {peak} bytes, model {model_peak:.0f} (compiled/model "
          f"{peak / model_peak:.3f}); {len(seen)} plan(s) evaluated, the last shown")
    problem, chosen = seen[-1]
    t, live = live_at_peak(problem, chosen)
    held = sum(b for b, _, _, w in live if w.startswith(("input", "output", "small")))
    print(f"the model's peak at {t}: inputs and outputs {held:.0f} bytes, activations "
          f"{sum(b for b, *_ in live) - held:.0f} (without the margin)")
    shown = set()
    for b, s, e, w in [x for x in live if not x[3].startswith(("input", "output", "small"))][
            :args.top]:
        print(f"  {b:9.0f}  [{s}, {e}]  {w}")
        m = re.search(r" of v(\d+)", w)
        if m:
            shown.add(int(m.group(1)))
    g = problem.graph
    for v in sorted(shown):
        src, k = problem.producer[v]
        print(f"v{v} {g.values[v].shape}: made as {chosen[src].out_specs[k]}, read as "
              + ", ".join(f"{chosen[problem.num_inputs + n.id].in_specs[i]} by {n.primitive} "
                          f"{n.name}" for n in g.nodes for i, u in enumerate(n.inputs) if u == v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
