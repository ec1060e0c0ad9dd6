"""Pipeline planning benchmark: GPT at a large size (abstract inputs, nothing allocated) on a
2-host x 4-device and an 8-host x 8-device A100 cluster. For each, the stage DP's plan
against pure intra-op parallelism and against uniform stage splits, by the cost model, and
the time planning took.

    .venv/bin/python benchmarks/pipeline_bench.py --size 6.7b --batch 64

With --spmd: the SPMD pipeline instead (the zoo's GPT with its layers scanned, one program in
shard_map over a `stage` axis) for 2, 4 and 8 stages against the intra-op plan of the same
step on the whole mesh, both by the cost model, and compiled on CPU devices and priced by the
profile where --compile names the cluster (abstract inputs: nothing allocated; 8x8 takes 64
CPU devices; both clusters at full size, 32 layers, batch 64, f32, both schedules, compile
and price in about 7 minutes here), and what pipeline="auto" keeps by the estimate and as
priced:

    .venv/bin/python benchmarks/pipeline_bench.py --spmd --size 6.7b --batch 64 \
        --dtype float32 --compile 2x4,8x8 --schedules gpipe,1f1b

What the SPMD pipeline's held layouts save (GPT 6.7B on 8x8, compiled and priced, before
each was held): the layers' backward in the plan's layouts (shardplan.inter.layer_backward;
autodiff of the forward's layouts all-reduced whole weights' gradients, 47 GB per device per
step at 4 stages, a 576 MB all-reduce per layer and tick) took GPipe at 8 layers and 4 stages
from 1.48 s to 1.09 s and 1F1B from 2.30 s to 1.51 s; the stacked parameters held where the
backward slices them (spmd_specs.stacked_specs) saved 1.5 s of fc1's and qkv's gathers at 4
stages; a matmul's result held (spmd_specs.body_operand_specs) saved the activation gathered
whole for qkv at 2 stages; the layers' result held (stage_body) a gather twice per layer and
tick and per ppermute; the stack of outputs written one slot a tick (emit.spmd) 1 GiB gathered
per tick. The estimate once counted the partial gradients the stack reads reduced twice (0.66
s of 1.65 s at 2 stages) and the updated stack's move whole (0.25 s). GPipe's head and loss,
run once at full batch, priced as well or better in XLA's own layouts as in the micro-batch
plan's (within 3% at GPT 6.7B on 8x8; 1.03x against 1.19x on a small GPT), so only 1F1B holds
them.

The model is the zoo's GPT with a shardplan.stage_boundary after every block but the last,
so the layers are the blocks (the embedding rides with the first, the head with the last).
Pure intra-op is shown two ways: the full-step ILP on the whole mesh
(shardplan.planning.intra_op.plan_graph, what shardplan.planning.pipelines.choose compares with; minutes on
8x8, skip it with --no-full-ilp), and costed like the stages (the sum of the layers' ILPs on
the whole mesh, the whole batch at once).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardplan.analysis import targets
from shardplan.cost.hardware import get_profile
from shardplan.grad import stage_boundary, value_and_grad
from shardplan.inter import planner, stage_io
from shardplan.inter import split as sp
from shardplan.inter import tables as tables_mod
from shardplan.inter.submesh import STAGE_AXES
from shardplan.intra.settings import IntraOptions
from shardplan.ir.trace import trace
from shardplan.models import base, get_config, layers
from shardplan.models import gpt as gpt_mod
from shardplan.options import SearchOptions
from shardplan.planning import compiled as compiled_mod
from shardplan.planning.intra_op import plan_step
from shardplan.planning.pipelines import choose
from shardplan.strategies.spec import MeshShape
from shardplan.units import fmt_seconds


class StagedGPT(nn.Module):
    """The zoo's GPT (same parameters) with a stage boundary between blocks."""

    cfg: layers.TransformerConfig

    @nn.compact
    def __call__(self, input_ids):
        c = self.cfg
        dtype, param_dtype = c.dtypes()
        init = nn.initializers.normal(c.init_std)
        wte = nn.Embed(c.vocab_size, c.hidden, dtype=dtype, param_dtype=param_dtype,
                       embedding_init=init, name="wte")
        wpe = nn.Embed(c.seq_len, c.hidden, dtype=dtype, param_dtype=param_dtype,
                       embedding_init=init, name="wpe")
        x = wte(input_ids) + wpe(jnp.arange(input_ids.shape[1]))[None]
        for i in range(c.num_layers):
            x = layers.Block(c, name=f"layer_{i}")(x, train=False)
            if i < c.num_layers - 1:
                x = stage_boundary(x)
        return wte.attend(layers.make_norm(c, "ln_f")(x))


def gpt_step(size: str, batch: int, dtype: str):
    """(step, abstract args) of a GPT train step written with shardplan.value_and_grad."""
    cfg = get_config("gpt", size, batch_size=batch, dropout_rate=0.0, dtype=dtype)
    model = StagedGPT(cfg)
    opt = base.make_optimizer(cfg)
    ids = jax.ShapeDtypeStruct((batch, cfg.seq_len), jnp.int32)
    params = jax.eval_shape(lambda k: model.init(k, jnp.zeros(ids.shape, jnp.int32)),
                            jax.random.PRNGKey(0))["params"]
    opt_state = jax.eval_shape(opt.init, params)

    def loss_fn(p, batch):
        return base.cross_entropy(model.apply({"params": p}, batch["input_ids"]), batch["labels"])

    def step(params, opt_state, batch):
        loss, grads = value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, opt_state, {"input_ids": ids, "labels": ids}), cfg


def clusters():
    a100 = get_profile("a100-80gb")
    return {"2x4": (dataclasses.replace(a100, devices_per_host=4, name="a100-80gb, 4 per host"),
                    (2, 4)),
            "8x8": (a100, (8, 8))}


def intra_by_layers(step, args, hw, shape) -> float:
    """Pure intra-op on the whole mesh, costed like a stage: one micro-batch, summed layer ILPs,
    plus the update."""
    s = sp.split_step(step, args, num_micro_batches=1)
    cluster = tables_mod.Cluster.of(MeshShape(STAGE_AXES, shape), hw)
    cache = tables_mod.CostTables(hw, cluster, IntraOptions())
    tables = tables_mod.build_tables(s, stage_io.layer_groups(s), cache, hw, hw.memory_bytes,
                                  shapes=[shape])
    m = tables.shapes.index(shape)
    L = len(tables.layers)
    return float(tables.problem([m]).cost[0, L - 1, 0]) + tables.update_s(hw, (0, L - 1), m)


def run(size: str, batch: int, micro: int, dtype: str, which, full_ilp: bool) -> list[dict]:
    step, args, _ = gpt_step(size, batch, dtype)
    rows = []
    for name in which:
        hw, shape = clusters()[name]
        mesh = MeshShape(STAGE_AXES, shape)
        t0 = time.perf_counter()
        pp = planner.plan_pipeline(step, args, mesh, hw, SearchOptions(num_micro_batches=micro))
        plan_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        intra = intra_by_layers(step, args, hw, shape)
        intra_s = time.perf_counter() - t0
        full, full_s = None, None
        if full_ilp:
            t0 = time.perf_counter()
            full = plan_step(trace(step, args), mesh, hw)[0]
            full, full_s = full.estimate.total_s, time.perf_counter() - t0
        # uniform splits from the same tables (the planner's session is rebuilt cheaply)
        s = pp.split
        cluster = tables_mod.Cluster.of(mesh, hw)
        cache = tables_mod.CostTables(hw, cluster, IntraOptions())
        uniform = {}
        for k in (2, 4, 8, 16):
            sh = planner.equal_shape(cluster, k)
            if sh is None or k > len(s.body):
                continue
            tables = tables_mod.build_tables(s, stage_io.layer_groups(s), cache, hw, hw.memory_bytes,
                                          shapes=[sh])
            c = planner.uniform_option(tables, cluster, k, hw)
            if c is not None:
                uniform[k] = c.total_s
        stages = "+".join("x".join(map(str, st.submesh_shape)) for st in pp.stages)
        rows.append({"cluster": name, "model": f"gpt-{size} b={batch} {dtype}",
                     "plan": f"{pp.num_stages} st ({stages}), B={pp.num_micro_batches}",
                     "planned": pp.chosen.total_s, "intra": intra, "full_ilp": full,
                     "uniform": uniform, "bubble": pp.estimate.bubble_fraction,
                     "plan_s": plan_s, "intra_s": intra_s, "full_s": full_s,
                     "explain": pp.explain()})
    return rows


def table(rows) -> str:
    ks = sorted({k for r in rows for k in r["uniform"]})
    head = ["cluster", "model", "planned pipeline", "T planned", "bubble",
            "intra-op (full-step ILP)", "intra-op (layer ILPs)",
            *[f"uniform {k} st" for k in ks], "planning", "full-step ILP"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def vs(t):
        return "-" if t is None else f"{fmt_seconds(t)} ({t / r['planned']:.2f}x)"

    for r in rows:
        cells = [r["cluster"], r["model"], r["plan"], fmt_seconds(r["planned"]),
                 f"{r['bubble']:.0%}", vs(r["full_ilp"]), vs(r["intra"]),
                 *[vs(r["uniform"].get(k)) for k in ks], f"{r['plan_s']:.0f} s",
                 "-" if r["full_s"] is None else f"{r['full_s']:.0f} s"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def scanned_gpt_step(size: str, batch: int, dtype: str):
    """(step, abstract args) of the zoo's GPT with scanned layers, its gradient taken with
    shardplan.value_and_grad (where the SPMD pipeline cuts)."""
    cfg = get_config("gpt", size, batch_size=batch, dropout_rate=0.0, dtype=dtype,
                     scan_layers=True)
    model = gpt_mod.GPT(cfg)
    ids = jax.ShapeDtypeStruct((batch, cfg.seq_len), jnp.int32)
    params = jax.eval_shape(lambda k: model.init(k, jnp.zeros(ids.shape, jnp.int32), train=False),
                            jax.random.PRNGKey(0))["params"]
    opt = base.make_optimizer(cfg)

    def loss_fn(p, _all, batch):
        return base.cross_entropy(model.apply({"params": p}, batch["input_ids"], train=False),
                                  batch["labels"]), None

    step = base.make_train_step(loss_fn, opt, "gpt", value_and_grad=value_and_grad)
    return step, (params, jax.eval_shape(opt.init, params), {"input_ids": ids, "labels": ids})


def run_spmd(size: str, batch: int, micro: int | None, dtype: str, which, compile_on,
             schedules=("1f1b",)) -> list:
    """The SPMD pipeline of 2, 4, 8 stages (each of `schedules`) against the intra-op plan,
    estimated and (for the clusters in `compile_on`) compiled on CPU devices and priced."""
    step, args = scanned_gpt_step(size, batch, dtype)
    traced = trace(step, args)
    rows = []
    for name in which:
        hw, shape = clusters()[name]
        mesh = MeshShape(("hosts", "devices"), shape)
        compiled = name in compile_on
        cpu = targets.cpu_mesh(mesh) if compiled else None
        t0 = time.perf_counter()
        intra, graph, _ = plan_step(traced, mesh, hw)
        row = {"cluster": name, "intra": intra.estimate.total_s,
               "intra_s": time.perf_counter() - t0, "spmd": {}}
        if compiled:
            dt = compiled_mod.compute_dtype(graph)
            row["intra_priced"] = compiled_mod.measure(graph, traced, intra, cpu, hw, "intra",
                                                  traced.state_argnums, dt).priced
        for S, sched in [(S, x) for x in schedules for S in (2, 4, 8)]:
            o = SearchOptions(pipeline="spmd", num_stages=S, num_micro_batches=micro,
                              schedule=sched)
            t0 = time.perf_counter()
            try:
                c = choose(step, args, mesh, hw, o, traced=traced)
            except ValueError as e:
                row["spmd"][(sched, S)] = {"error": str(e)[:120]}
                continue
            r = {"estimate": c.plan.estimate.total_s, "M": c.plan.num_micro_batches,
                 "schedule": "GPipe" if sched == "gpipe" else "1F1B",
                 "bubble": c.plan.estimate.bubble_fraction, "plan_s": time.perf_counter() - t0,
                 "note": c.plan.notes[-1]}
            if compiled:
                _, priced = compiled_mod.price_spmd(step, args, c.plan, cpu, hw, dt,
                                               traced.state_argnums)
                r["priced"] = priced
            row["spmd"][(sched, S)] = r
        rows.append(row)
    return rows


def spmd_table(rows) -> str:
    lines = ["| cluster | plan | model estimate | compiled, priced | model / priced |",
             "|---|---|---|---|---|"]

    def cells(name, est, priced):
        p = "estimate only (not compiled)" if priced is None else fmt_seconds(priced.total_s)
        ratio = "-" if priced is None else f"{est / priced.total_s:.2f}"
        return f"| {name} | {est_label} | {fmt_seconds(est)} | {p} | {ratio} |"

    for r in rows:
        est_label = "intra-op (full-step ILP)"
        lines.append(cells(r["cluster"], r["intra"], r.get("intra_priced")))
        for (sched, S), x in r["spmd"].items():
            if "error" in x:
                lines.append(f"| {r['cluster']} | SPMD {sched} {S} stages | {x['error']} | - "
                             "| - |")
                continue
            est_label = (f"SPMD {x['schedule']} {S} stages, M={x['M']}, bubble "
                         f"{x['bubble']:.0%}")
            lines.append(cells(r["cluster"], x["estimate"], x.get("priced")))
    lines.append("")
    for r in rows:
        lines.append(f"{r['cluster']}: pipeline='auto' keeps {_pick(r, 'estimate')} by the cost "
                     "model" + (f", {_pick(r, 'priced')} as compiled and priced"
                                if r.get("intra_priced") is not None else ""))
    return "\n".join(lines)


def _pick(row, by: str) -> str:
    """What pipeline='auto' keeps: the SPMD pipeline whose step (estimated, or compiled and
    priced) beats the intra-op plan's by the most, else the intra-op plan."""
    def time_of(x):
        if by == "estimate":
            return x.get("estimate")
        return x["priced"].total_s if x.get("priced") is not None else None

    intra = row["intra"] if by == "estimate" else row["intra_priced"].total_s
    best = min(((t, S, x["schedule"]) for (_, S), x in row["spmd"].items()
                if (t := time_of(x)) is not None), default=None)
    if best is None or best[0] >= intra:
        return "the intra-op plan"
    return f"the SPMD pipeline of {best[1]} stages, {best[2]} ({intra / best[0]:.2f}x)"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="6.7b", help="zoo GPT size (default 6.7b)")
    p.add_argument("--batch", type=int, default=64, help="sequences per step")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="default: the planner chooses")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--clusters", default="2x4,8x8")
    p.add_argument("--no-full-ilp", dest="full_ilp", action="store_false",
                   help="skip the full-step intra-op ILP (minutes on 8x8)")
    p.add_argument("--spmd", action="store_true",
                   help="the SPMD pipeline of a scanned GPT against intra-op")
    p.add_argument("--compile", default="2x4",
                   help="clusters whose programs are compiled on CPU devices and priced "
                        "(--spmd; 8x8 takes 64 CPU devices)")
    p.add_argument("--schedules", default="1f1b",
                   help="--spmd: the pipeline schedules to compare, e.g. gpipe,1f1b")
    a = p.parse_args(argv)
    if a.spmd:
        on = [c for c in a.compile.split(",") if c]
        n = max([int(np.prod(clusters()[c][1])) for c in on] + [1])
        jax.config.update("jax_num_cpu_devices", n)
        rows = run_spmd(a.size, a.batch, a.micro_batches, a.dtype, a.clusters.split(","), on,
                        tuple(a.schedules.split(",")))
        for r in rows:
            for (sched, S), x in r["spmd"].items():
                print(f"== {r['cluster']} SPMD {sched} {S} stages:",
                      x.get("note", x.get("error")))
        print()
        print("step times priced as a100-80gb: the cost model's estimate, and the program "
              "compiled by XLA on CPU devices standing in for the cluster")
        print(spmd_table(rows))
        return
    rows = run(a.size, a.batch, a.micro_batches, a.dtype, a.clusters.split(","), a.full_ilp)
    for r in rows:
        print(f"== {r['cluster']}: planned in {r['plan_s']:.1f} s "
              f"(intra-op baseline {r['intra_s']:.1f} s)")
        print(r["explain"])
    print()
    print("estimated step times by the cost model; (Nx) = that time / the planned pipeline's")
    print(table(rows))


if __name__ == "__main__":
    main()
