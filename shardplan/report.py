"""Reports of a planning run: report.md with PNG plots (matplotlib Figures, Agg). The
benchmark's bench.md / bench.csv are shardplan.bench.

A Run holds what the CLI learned about one config: the plan, and, when the programs were
compiled, the plan and every baseline priced by one hardware profile (analysis/price.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

from shardplan.analysis.price import PricedStep
from shardplan.options import DEFAULTS
from shardplan.plan import Estimate, Plan
from shardplan.report_snippet import StepCall, use_this_plan
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
    of: str = "the plan"
    """Whose predictions: the plan's, or the searched plan's where an expert plan was kept."""


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
        label, e = model_estimate(self.plan)
        out = [] if e is None else [(label, e.compute_s, e.comm_s, e.total_s, e.peak_bytes,
                                     e.comm_bytes)]
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


def compiled_by(run: Run) -> str:
    """Which compiler compiled the programs compared (the plan's record of it, without the
    reason a stand-in was used), e.g. 'XLA:CPU (jaxlib 0.10.2) standing in for a100-80gb'."""
    by = run.plan.compiled_by.split(": ", 1)[0]
    return by or "XLA:CPU on CPU devices standing in for the cluster"


def model_estimate(plan: Plan) -> tuple[str, Estimate | None]:
    """The cost model's figures for the plan and what they are of: the plan's own; where the
    measured selection kept an expert plan the cost model never priced (input shardings only,
    XLA propagating the rest), the searched plan's, labelled so; None if neither exists."""
    e = plan.model_estimate or plan.estimate
    if e.total_s > 0 or e.peak_bytes > 0:
        return "plan (cost model)", e
    searched = next((c.plan for c in plan.candidates if c.name == "searched"), None)
    if searched is not None:
        return "searched plan (cost model)", searched.model_estimate or searched.estimate
    return "plan (cost model)", None


def verification(plan: Plan, label: str, e: Estimate, stats, priced: PricedStep,
                 forms_reduce_scatter: bool) -> Verification | None:
    """The cost model's predictions (`e`, labelled `label` by model_estimate) against the
    compiled program they are of: the kept plan's (`stats`, `priced`), or, where the measured
    selection kept an expert plan the model never priced, the searched plan's (compiled as a
    candidate)."""
    if label == "plan (cost model)":
        if forms_reduce_scatter:
            stats = stats.formed()  # as a GPU/TPU compiler runs it, like the pricing
        return Verification(e.comm_bytes, stats.bytes_sent, e.peak_bytes, stats.peak_bytes,
                            e.compute_s, priced.compute_s, stats.by_kind())
    c = next((c.priced for c in plan.candidates if c.name == "searched"), None)
    if c is None:
        return None
    return Verification(e.comm_bytes, c.bytes_sent, e.peak_bytes, c.peak_bytes, e.compute_s,
                        c.compute_s, {k: (v.count, v.bytes_sent) for k, v in c.per_kind.items()},
                        of="the searched plan")


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
    as 'other'; by primitive (the costliest 11, then 'other primitives') when no op name has
    a layer. The groups add up to the cost model's step (model_estimate), column by column:
    where the estimate holds more than the ops' own costs (values resharded between ops, the
    step's inputs read and outputs written), a last 'outside the ops' group holds the
    difference; where it holds less (the estimate pays one
    latency for all-reduces XLA combines across layers, and nothing for partial sums XLA has
    already reduced, which each op prices alone), every group's share is scaled down alike."""
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
        keys = sorted(groups, key=lambda k: -sum(groups[k]))
        if len(keys) > 12:
            rest = [sum(groups[k][c] for k in keys[11:]) for c in (0, 1)]
            keys = keys[:11] + ["other primitives"]
            groups["other primitives"] = rest
    rows = [[k, groups[k][0], groups[k][1]] for k in keys]
    e = model_estimate(plan)[1]
    if not rows or e is None:
        return [tuple(r) for r in rows]
    extra = [0.0, 0.0]
    for c, total in ((1, e.compute_s), (2, e.comm_s)):
        own = sum(r[c] for r in rows)
        if total > own:
            extra[c - 1] = total - own
        elif own > 0:
            for r in rows:
                r[c] *= total / own
    if extra[1] > 1e-3 * max(e.total_s, 1e-30) or extra[0] > 1e-3 * max(e.total_s, 1e-30):
        rows.append(["outside the ops", extra[0], extra[1]])
    else:  # a rounding's worth: kept in the last group so the sum stays the step's
        rows[-1][1] += extra[0]
        rows[-1][2] += extra[1]
    return [tuple(r) for r in rows]


# -- plots ----------------------------------------------------------------------------------


def memory_rows(run: Run) -> list[tuple]:
    """The rows of the memory plot: every program once (the plan compiled, once compiled)."""
    return [r for r in run.rows()
            if not (r[0].endswith("(cost model)") and run.priced_plan is not None)]


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
        estimate_only = name.endswith("(cost model)") and run.priced_plan is not None
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


def report_markdown(run: Run, images: Sequence[tuple[str, str]] = (),
                    call: StepCall | None = None) -> str:
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
        compiler = compiled_by(run)
        text = (f"Every `(XLA)` row is a program compiled by {compiler} and priced with the "
                f"`{run.hardware}` profile (flops at its peak, every collective of the "
                "partitioned HLO at the alpha-beta cost of the links it spans).")
        if compiler.startswith("XLA:CPU") and run.hardware != "cpu":
            text += (" Where XLA:CPU keeps an all-reduce whose result each device only slices, "
                     "or sends bf16 values widened to f32, the accelerator profile prices the "
                     "reduce-scatter and the bf16 bytes a GPU/TPU would run, alike for the plan "
                     "and the baselines (`shardplan/analysis/price.py`).")
        lines += [text, ""]
    lines += md_table(COMPARISON_HEADER, comparison_rows(run))
    lines.append("")
    if run.ratio() is not None:
        lines += [f"**{run.ratio_text()}.**", ""]
    if run.verification is not None:
        lines += [f"## Predicted vs compiled ({run.verification.of})", ""]
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
    lines += use_this_plan(run.plan, call)
    notes = tuple(plan.notes) + tuple(run.notes)
    if notes:
        lines += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    return "\n".join(lines)
