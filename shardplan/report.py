"""Reports of a planning run: report.md with PNG plots (matplotlib Figures, Agg). The
benchmark's bench.md / bench.csv are shardplan.bench.

A Run holds what the CLI learned about one config: the plan, and, when the programs were
compiled, the plan and every baseline priced by one hardware profile (analysis/price.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence

from shardplan import timeline
from shardplan.analysis.price import PricedStep
from shardplan.options import DEFAULTS
from shardplan.plan import Estimate, Plan
from shardplan.units import fmt_bytes, fmt_seconds

BASELINE_ORDER = ("data_parallel", "fsdp", "megatron", "two_d")


@dataclasses.dataclass(frozen=True)
class Verification:
    """The plan's predictions against its compiled program (hlo.analyze)."""

    predicted_comm_bytes: float
    compiled_comm_bytes: float
    predicted_peak_bytes: float
    compiled_peak_bytes: float
    predicted_compute_s: float
    compiled_compute_s: float
    collectives: Mapping[str, tuple[int, float]]
    """kind -> (executions, bytes sent per device) in the compiled plan."""


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything one `shardplan search` found out, for the console, report.md and bench."""

    label: str
    """The model and size, e.g. gpt-gpt2-124m."""
    description: str
    hardware: str
    budget: float
    """Memory budget per device, bytes."""
    plan: Plan
    num_params: int = 0
    dtype: str = "float32"
    priced_plan: PricedStep | None = None
    """The plan compiled by XLA on CPU devices and priced; None when not compiled."""
    searched: PricedStep | None = None
    """The searched plan alone (before the measured selection kept the cheapest candidate)
    compiled and priced; None when not compiled. The plan itself when nothing was measured."""
    baselines: Mapping[str, PricedStep | str] = dataclasses.field(default_factory=dict)
    """Baseline name -> its priced compiled program, or why it has none."""
    meshes: Mapping[str, float | str] = dataclasses.field(default_factory=dict)
    """Every mesh planned -> the estimate's step time, or why it has no plan."""
    verification: Verification | None = None
    search_s: float = 0.0
    """Wall-clock seconds of planning (all meshes)."""
    compile_s: float = 0.0
    schedule: str = DEFAULTS.schedule
    num_micro_batches: int = 1
    notes: tuple[str, ...] = ()

    @property
    def mesh(self) -> str:
        return mesh_str(self.plan)

    def fits(self, peak: float) -> bool:
        return peak <= self.budget

    def rows(self) -> list[tuple[str, float, float, float, float, float | None]]:
        """(name, compute_s, comm_s, total_s, peak_bytes, bytes sent) per program compared: the
        plan's estimate, the compiled plan, the compiled baselines."""
        e = self.plan.model_estimate or self.plan.estimate
        out = [("plan (cost model)", e.compute_s, e.comm_s, e.total_s, e.peak_bytes, e.comm_bytes)]
        if self.priced_plan is not None:
            out.append(("plan (XLA)",) + _figures(self.priced_plan))
        if self.searched is not None and self.searched is not self.priced_plan:
            out.append(("searched plan alone (XLA)",) + _figures(self.searched))
        for name in _ordered(self.baselines):
            p = self.baselines[name]
            if isinstance(p, PricedStep):
                out.append((f"{name} (XLA)",) + _figures(p))
        return out

    def best_baseline(self) -> tuple[str, PricedStep] | None:
        """The fastest priced baseline that fits the budget (or the fastest, if none fits)."""
        priced = [(n, p) for n, p in self.baselines.items() if isinstance(p, PricedStep)]
        fitting = [(n, p) for n, p in priced if self.fits(p.peak_bytes)] or priced
        return min(fitting, key=lambda x: x[1].total_s) if fitting else None

    def plan_peak(self) -> tuple[float, str]:
        """The plan's one memory figure and what it is: the compiled program's peak once
        compiled, else the plan's estimate (itself compiled with measure=True)."""
        if self.priced_plan is not None:
            return self.priced_plan.peak_bytes, "compiled by XLA"
        return self.plan.estimate.peak_bytes, self.plan.estimate_source

    def plan_total(self) -> float:
        """Priced step time of the compiled plan, else the cost model's estimate."""
        return self.priced_plan.total_s if self.priced_plan else self.plan.estimate.total_s

    def best_fits(self) -> bool:
        """Whether the best baseline fits the budget (False: none does, it is just the fastest)."""
        best = self.best_baseline()
        return best is not None and self.fits(best[1].peak_bytes)

    def ratio_text(self) -> str:
        """'plan / best baseline (name): 0.83x', saying so when no baseline fits the budget."""
        ratio, best = self.ratio(), self.best_baseline()
        if ratio is None:
            return ""
        if self.best_fits():
            return f"plan / best baseline ({best[0]}): {ratio:.2f}x step time"
        return (f"no baseline fits the budget of {fmt_bytes(self.budget)}; plan / fastest "
                f"baseline ({best[0]}, over budget): {ratio:.2f}x step time")

    def ratio(self) -> float | None:
        """plan / best baseline step time (priced alike); below 1 the plan is faster."""
        return self._over_best(self.priced_plan)

    def searched_ratio(self) -> float | None:
        """The searched plan alone over the best baseline: what measure=False gives."""
        return self._over_best(self.searched)

    def _over_best(self, priced: PricedStep | None) -> float | None:
        best = self.best_baseline()
        if best is None or priced is None or best[1].total_s <= 0:
            return None
        return priced.total_s / best[1].total_s


def compiled_plan(plan: Plan, priced: PricedStep) -> Plan:
    """The plan with its compiled program's figures as its estimate (as measure=True keeps
    them) and the cost model's own kept as `model_estimate`: one figure per program."""
    e = plan.estimate
    return dataclasses.replace(
        plan, model_estimate=plan.model_estimate or e,
        estimate=Estimate(priced.compute_s, priced.comm_s, priced.peak_bytes, e.state_bytes,
                          priced.bytes_sent, e.bubble_fraction))


def _figures(p: PricedStep):
    return p.compute_s, p.comm_s, p.total_s, p.peak_bytes, p.bytes_sent


def _ordered(names) -> list[str]:
    rank = {n: i for i, n in enumerate(BASELINE_ORDER)}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))


def mesh_str(plan: Plan) -> str:
    return " x ".join(f"{n}={s}" for n, s in zip(plan.mesh.names, plan.mesh.sizes))


# -- per-layer costs ------------------------------------------------------------------------

_LAYER = re.compile(r"(?:^|[/_(])((?:layer|block|layers|blocks|stage)_\d+)(?=$|[/)_])")


def layer_of(op_name: str) -> str | None:
    """The layer part of an op name ('jvp(GPT)/layer_3/mlp' -> 'layer_3'), or None."""
    m = _LAYER.search(op_name)
    return m.group(1) if m else None


def cost_by_layer(plan: Plan) -> list[tuple[str, float, float]]:
    """(group, compute_s, comm_s) of the plan's ops grouped by layer in layer order, the rest
    as 'other'; by primitive (costliest 12) when no op name has a layer. A last 'resharding'
    group holds the estimate's time between ops (values moved from one spec to another)."""
    groups: dict[str, list[float]] = {}
    has_layers = any(layer_of(o.name) for o in plan.ops)
    for o in plan.ops:
        key = (layer_of(o.name) or "other") if has_layers else o.primitive
        acc = groups.setdefault(key, [0.0, 0.0])
        acc[0] += o.compute_s
        acc[1] += o.comm_s
    if has_layers:
        def order(k):
            m = re.search(r"\d+$", k)
            return (k == "other", re.sub(r"_\d+$", "", k), int(m.group()) if m else 0)
        keys = sorted(groups, key=order)
    else:
        keys = sorted(groups, key=lambda k: -sum(groups[k]))[:12]
    rows = [(k, groups[k][0], groups[k][1]) for k in keys]
    # what the estimate holds beyond the ops' own costs: resharding between them (ILP edges)
    e = plan.estimate
    rest = (e.compute_s - sum(g[0] for g in groups.values()),
            e.comm_s - sum(g[1] for g in groups.values()))
    if plan.ops and rest[1] > 1e-3 * max(e.total_s, 1e-30):
        rows.append(("resharding", max(rest[0], 0.0), rest[1]))
    return rows


# -- plots ----------------------------------------------------------------------------------


def _figure(figsize):
    """A bare matplotlib Figure and its axes: drawn with Agg, no global pyplot state.
    matplotlib is heavy and only needed to draw: imported here, lazily."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    return fig, fig.add_subplot(1, 1, 1)


def plot_layer_costs(plan: Plan, path: str) -> str | None:
    """Stacked compute / communication time per layer of the plan (cost model)."""
    rows = cost_by_layer(plan)
    if not rows:
        return None
    fig, ax = _figure((max(6.0, 0.35 * len(rows) + 2), 3.6))
    xs = range(len(rows))
    comp = [r[1] * 1e3 for r in rows]
    comm = [r[2] * 1e3 for r in rows]
    ax.bar(xs, comp, label="compute", color="#4C72B0")
    ax.bar(xs, comm, bottom=comp, label="communication", color="#DD8452")
    ax.set_xticks(list(xs), [r[0] for r in rows], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("ms per step (cost model)")
    ax.set_title(f"plan cost per layer, mesh {mesh_str(plan)}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def memory_rows(run: Run) -> list[tuple]:
    """The rows of the memory plot: every program once (the plan compiled, once compiled)."""
    return [r for r in run.rows()
            if not (r[0] == "plan (cost model)" and run.priced_plan is not None)]


def plot_memory(run: Run, path: str) -> str:
    """Peak memory per device of every program compared, against the budget: the plan's one
    figure (compiled once compiled, labelled so), not also its estimate."""
    rows = memory_rows(run)
    fig, ax = _figure((7, 0.5 * len(rows) + 1.5))
    top = max([r[4] for r in rows] + [1.0])
    unit, scale = next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10),
                                           ("B", 1)) if top >= s)
    values = [r[4] / scale for r in rows]
    colors = ["#55A868" if run.fits(r[4]) else "#C44E52" for r in rows]
    ax.barh(range(len(rows)), values, color=colors)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    title = f"{run.label} on {run.hardware}, mesh {run.mesh}"
    if run.budget <= 3 * top:
        ax.axvline(run.budget / scale, color="black", linestyle="--",
                   label=f"budget {fmt_bytes(run.budget)}")
        ax.legend(loc="lower right")
    else:
        title += f"\n(budget {fmt_bytes(run.budget)} per device, off the scale)"
    ax.set_xlabel(f"peak memory per device ({unit})")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_step_times(run: Run, path: str) -> str:
    """Stacked compute / communication step time of every program compared."""
    rows = run.rows()
    fig, ax = _figure((7, 0.5 * len(rows) + 1.5))
    comp = [r[1] * 1e3 for r in rows]
    comm = [r[2] * 1e3 for r in rows]
    ys = range(len(rows))
    ax.barh(ys, comp, color="#4C72B0", label="compute")
    ax.barh(ys, comm, left=comp, color="#DD8452", label="communication")
    ax.set_yticks(list(ys), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"ms per step on {run.hardware}")
    ax.set_title(f"{run.label}, mesh {run.mesh}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_timeline(run: Run, path: str) -> str | None:
    """The pipeline schedule of a staged plan (shardplan.timeline, from the cost model)."""
    timeline.draw_plan(run.plan, path)
    return path if os.path.exists(path) else None


# -- report.md ------------------------------------------------------------------------------


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    def cell(x):
        return str(x).replace("|", "\\|")

    return ["| " + " | ".join(map(cell, header)) + " |",
            "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(map(cell, r)) + " |" for r in rows)]


def comparison_rows(run: Run) -> list[list[str]]:
    """The comparison table's cells: program, compute, comm, total, vs plan, peak, fits, sent."""
    base = run.plan_total()
    out = []
    for name, comp, comm, total, peak, sent in run.rows():
        vs = f"{total / base:.2f}x" if base > 0 else "-"
        # once compiled, the compiled row's peak is the plan's memory figure and verdict
        estimate_only = name == "plan (cost model)" and run.priced_plan is not None
        fits = "(estimate)" if estimate_only else "yes" if run.fits(peak) else "NO"
        out.append([name, fmt_seconds(comp), fmt_seconds(comm), fmt_seconds(total), vs,
                    fmt_bytes(peak), fits, fmt_bytes(sent) if sent is not None else "-"])
    for name in _ordered(run.baselines):
        if not isinstance(run.baselines[name], PricedStep):
            out.append([name, "-", "-", "-", "-", "-", "-", str(run.baselines[name])])
    return out


COMPARISON_HEADER = ("program", "compute", "comm", "total", "vs plan", "peak memory",
                     "fits budget", "sent / device")


def verification_rows(v: Verification) -> list[list[str]]:
    def ratio(a, b):
        return f"{b / a:.2f}" if a else "-"

    return [
        ["communication sent / device", fmt_bytes(v.predicted_comm_bytes),
         fmt_bytes(v.compiled_comm_bytes), ratio(v.predicted_comm_bytes, v.compiled_comm_bytes)],
        ["peak memory / device", fmt_bytes(v.predicted_peak_bytes),
         fmt_bytes(v.compiled_peak_bytes), ratio(v.predicted_peak_bytes, v.compiled_peak_bytes)],
        ["compute time", fmt_seconds(v.predicted_compute_s), fmt_seconds(v.compiled_compute_s),
         ratio(v.predicted_compute_s, v.compiled_compute_s)],
    ]


def write_report(run: Run, out_dir: str, formats: Sequence[str] = ("json", "md", "png")) -> list[str]:
    """Write report.md (and its PNG plots) into out_dir; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []
    images: list[tuple[str, str]] = []
    if "png" in formats:
        for title, fname, fn in (
            ("Step time: plan vs baselines", "step_time.png", lambda p: plot_step_times(run, p)),
            ("Memory per device against the budget", "memory.png", lambda p: plot_memory(run, p)),
            ("Plan cost per layer", "cost_per_layer.png", lambda p: plot_layer_costs(run.plan, p)),
        ):
            path = fn(os.path.join(out_dir, fname))
            if path:
                written.append(path)
                images.append((title, fname))
        if run.plan.stages:
            path = plot_timeline(run, os.path.join(out_dir, "timeline.png"))
            if path:
                written.append(path)
                images.append(("Pipeline timeline", "timeline.png"))
    if "md" in formats:
        path = os.path.join(out_dir, "report.md")
        with open(path, "w") as f:
            f.write(report_markdown(run, images))
        written.append(path)
    return written


def use_this_plan(run: Run) -> list[str]:
    """The report's "use this plan" section: the code that loads plan.json and runs it."""
    names, sizes = run.plan.mesh.names, run.plan.mesh.sizes
    return ["## Use this plan", "",
            ("The plan is saved as `plan.json` beside this report. Run your step with it (no "
             "search; shardplan checks that the step, its input shapes and the mesh are the "
             "ones it was planned for):"), "", "```python", "import jax", "import shardplan", "",
            'plan = shardplan.load_plan("plan.json")',
            f"mesh = jax.make_mesh({tuple(sizes)}, {tuple(names)})",
            "# donate_argnums: the positions of the state (parameters, optimizer state)",
            "step = shardplan.auto(train_step, mesh=mesh, plan=plan, donate_argnums=(0, 1))",
            "state, *rest = step(state, batch)      # the same arguments as train_step", "```",
            "", "`shardplan show plan.json` prints its summary.", ""]


def report_markdown(run: Run, images: Sequence[tuple[str, str]] = ()) -> str:
    plan, e = run.plan, run.plan.estimate
    lines = [f"# shardplan: {run.label} on {run.hardware}", ""]
    if run.description:
        lines += [run.description, ""]
    lines += [
        f"- mesh: {run.mesh} ({plan.mesh.num_devices} devices), hardware profile `{run.hardware}`",
        f"- parameters: {run.num_params / 1e6:,.1f} M, dtype {run.dtype}",
        f"- memory budget: {fmt_bytes(run.budget)} per device",
        (f"- plan ({plan.estimate_source}): {fmt_seconds(e.total_s)} per step = compute "
         f"{fmt_seconds(e.compute_s)} + communication {fmt_seconds(e.comm_s)}; state "
         f"{fmt_bytes(e.state_bytes)} per device"),
        (f"- peak memory ({run.plan_peak()[1]}): {fmt_bytes(run.plan_peak()[0])} per device: "
         f"{'fits' if run.fits(run.plan_peak()[0]) else 'DOES NOT FIT'} the budget"),
        f"- search: {run.search_s:.1f} s ({plan.solver})", "",
    ]
    if len(run.meshes) > 1:
        lines += ["## Meshes tried", ""]
        lines += md_table(("mesh", "estimate"), [
            (m, fmt_seconds(t) if isinstance(t, float) else t) for m, t in run.meshes.items()])
        lines.append("")
    if plan.stages:
        lines += ["## Pipeline stages", ""]
        lines += md_table(("stage", "layers", "submesh", "time", "memory"), [
            (str(i), f"{s.layers[0]}-{s.layers[1]}", "x".join(map(str, s.submesh_shape)),
             fmt_seconds(s.estimate.total_s), fmt_bytes(s.estimate.peak_bytes))
            for i, s in enumerate(plan.stages)])
        lines.append("")
    lines += ["## Plan vs baselines", ""]
    if run.priced_plan is not None:
        lines += [("Every `(XLA)` row is a program compiled by XLA on CPU devices standing in "
                   f"for the cluster and priced with the `{run.hardware}` profile (flops at its "
                   "peak, every collective of the partitioned HLO at the alpha-beta cost of the "
                   "links it spans). Where XLA:CPU keeps an all-reduce whose result each device "
                   "only slices, or sends bf16 values widened to f32, an accelerator profile "
                   "prices the reduce-scatter and the bf16 bytes a GPU/TPU would run, alike for "
                   "the plan and the baselines (`shardplan/analysis/price.py`)."), ""]
    lines += md_table(COMPARISON_HEADER, comparison_rows(run))
    lines.append("")
    if run.ratio() is not None:
        lines += [f"**{run.ratio_text()}.**", ""]
    if run.verification is not None:
        lines += ["## Predicted vs compiled (the plan)", ""]
        lines += md_table(("quantity", "predicted", "compiled", "compiled / predicted"),
                           verification_rows(run.verification))
        lines.append("")
        lines += md_table(("collective", "count", "sent / device"), [
            (k, str(n), fmt_bytes(b)) for k, (n, b) in run.verification.collectives.items()])
        lines.append("")
    for title, fname in images:
        lines += [f"## {title}", "", f"![{title}]({fname})", ""]
    lines += ["## Input shardings (grouped by layer pattern)", ""]
    lines += md_table(("inputs", "PartitionSpec", "count"),
                       [(f"`{p}`", f"`{s}`", str(n)) for p, s, n in plan.param_table()])
    lines.append("")
    if plan.ops:
        lines += ["## Costliest operators (cost model)", ""]
        ops = sorted(plan.ops, key=lambda o: -(o.compute_s + o.comm_s))[:20]
        lines += md_table(("op", "name", "strategy", "compute", "comm"), [
            (o.primitive, o.name[-60:], o.strategy, fmt_seconds(o.compute_s),
             fmt_seconds(o.comm_s)) for o in ops])
        lines.append("")
    lines += use_this_plan(run)
    notes = tuple(plan.notes) + tuple(run.notes)
    if notes:
        lines += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    return "\n".join(lines)
