"""The YAML schema of the CLI: model x cluster x search x output, typed, unknown keys are errors.

    model:   {name: gpt, size: gpt2-124m, batch_size: 8}      # or {entry: "pkg.mod:fn"}
    cluster: {hardware: a100-80gb, mesh: {shape: [2, 4], axes: [data, model]},
              memory_budget: 40GiB}                           # or mesh: {devices: 8}
    search:  {pipeline: auto, num_micro_batches: 1, schedule: 1f1b, time_limit: 30,  # SearchOptions
              hints: {"2/**": [data]}}
    output:  {dir: shardplan-out, formats: [json, md, png]}

`load_config(path, ["model.size=gpt2-1.5b"])` reads a file, applies `--set` overrides (values
parsed as YAML), checks the structure (pydantic) and then what only the zoo and the profiles
know (model names and sizes, config fields, hardware profiles). Every error is a ConfigError
naming the dotted key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shardplan import files, models
from shardplan.cluster import check_auto_devices
from shardplan.cost.hardware import HardwareProfile, get_profile
from shardplan.options import DEFAULTS, Hints, SearchOptions
from shardplan.planning.job import mesh_shapes
from shardplan.units import parse_bytes

DTYPES = ("float32", "bfloat16", "float16")
BASELINE_NAMES = ("data_parallel", "fsdp", "megatron", "two_d", "maxtext")
FORMATS = ("json", "md", "png")
MAX_COMPILE_DEVICES = 64


class ConfigError(ValueError):
    """A config that cannot be used: `key` is the dotted path of the culprit (or None)."""

    def __init__(self, key: str | None, message: str, source: str | None = None):
        self.key, self.message, self.source = key, message, source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{key}: {message}" if key else f"{where}{message}")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ModelSection(_Section):
    """What to plan: a zoo model at a named size, or the user's own step (`entry`)."""

    name: str | None = None
    """A zoo model (shardplan.models.list_models()): gpt, llama, moe, bert, vit, wresnet, mlp."""
    size: str = "tiny"
    """A size of that model (shardplan.models.list_sizes(name)), e.g. gpt2-124m, 6.7b."""
    batch_size: int | None = Field(None, gt=0)
    """Global batch size (examples per step); default the size's."""
    seq_len: int | None = Field(None, gt=0)
    """Sequence length, for the language models; default the size's."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Activation dtype; also picks the peak flops that price the step. Default the size's."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Other fields of the model's config (num_layers, hidden, ...), checked against it."""
    entry: str | None = None
    """"package.module:function" returning a TrainStep or (fn, args) with abstract args.
    The module is imported and the function called, with your permissions, as running a
    Python script would: a config naming an entry runs that code (any importable function,
    `os:system` too). A config is code: run only configs you trust."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for `entry`."""

    @model_validator(mode="after")
    def _one_source(self):
        if (self.name is None) == (self.entry is None):
            raise ValueError("give either `name` (a zoo model) or `entry` "
                             "('package.module:function'), not both or neither")
        if self.entry is not None and not re.fullmatch(r"[\w.]+:[\w.]+", self.entry):
            raise ValueError(f"entry {self.entry!r} is not of the form 'package.module:function'")
        return self

    @property
    def label(self) -> str:
        return f"{self.name}-{self.size}" if self.name else str(self.entry)

    def zoo_overrides(self) -> dict[str, Any]:
        """Config-field overrides for shardplan.models.get_model (batch_size apart)."""
        out = dict(self.overrides)
        for key in ("seq_len", "dtype"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class MeshSection(_Section):
    """The device mesh: a fixed shape, or a device count whose shape is searched."""

    shape: tuple[int, ...] | None = None
    """Devices along each mesh axis, major first, e.g. [2, 4]; row-major over hosts."""
    axes: tuple[str, ...] | None = None
    """Names of the axes; default [devices] for 1-D, [data, model] for 2-D."""
    devices: int | None = Field(None, gt=0)
    """Instead of `shape`: plan every factorisation into at most 2 axes, keep the cheapest."""

    @model_validator(mode="after")
    def _check(self):
        if (self.shape is None) == (self.devices is None):
            raise ValueError("give either `shape: [d0, d1, ...]` or `devices: N`")
        if self.shape is not None:
            if not self.shape or any(s < 1 for s in self.shape):
                raise ValueError(f"shape {list(self.shape)} must list axis sizes >= 1")
            if self.axes is not None and len(self.axes) != len(self.shape):
                raise ValueError(f"axes {list(self.axes)} and shape {list(self.shape)} differ in "
                                 "length: name every axis")
        elif self.axes is not None and len(self.axes) > 2:
            raise ValueError("with `devices`, give at most 2 axis names (for 1-D and 2-D meshes)")
        if self.axes is not None and len(set(self.axes)) != len(self.axes):
            raise ValueError(f"axes {list(self.axes)} repeat a name")
        if self.devices is not None:
            check_auto_devices(self.devices)
        return self

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape) if self.shape is not None else int(self.devices)

    def candidates(self) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
        """(axis names, shape) of every mesh to plan: the given one, or all 1-D and 2-D
        factorisations of `devices` (axes of size 1 left out)."""
        if self.shape is not None:
            return [(self.axes or _default_axes(len(self.shape)), tuple(self.shape))]
        return mesh_shapes(int(self.devices), self.axes)


def _default_axes(ndim: int) -> tuple[str, ...]:
    return {1: ("devices",), 2: ("data", "model")}.get(ndim, tuple(f"axis{i}" for i in range(ndim)))


class ClusterSection(_Section):
    """Where the step runs: a hardware profile, a mesh and the memory per device."""

    hardware: str
    """A profile of shardplan.cost.hardware.PROFILES (tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e,
    a100-80gb, h100-80gb, cpu) or the path of a YAML file with HardwareProfile's fields (relative to the config)."""
    mesh: MeshSection
    """{shape: [2, 4], axes: [data, model]} or {devices: 8}."""
    memory_budget: int | None = None
    """Bytes per device, an int or a string like "16GiB"; default the profile's memory."""

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _bytes(cls, value):
        return parse_bytes(value)


class SearchSection(_Section):
    """How to search: SearchOptions' fields (defaults from there, but the CLI's own below)."""

    pipeline: bool | Literal["auto", "spmd", "mpmd"] = "auto"
    """Split into pipeline stages: auto (where the cost model says they pay), true (always: an
    SPMD pipeline where the layers are one scan, else MPMD stages), false (never), spmd or
    mpmd (that kind only); see shardplan.SearchOptions.pipeline."""
    num_micro_batches: int = Field(1, ge=1)
    """Micro-batches per step for a pipeline (the batch must divide)."""
    schedule: Literal["1f1b", "gpipe"] = DEFAULTS.schedule
    """Pipeline schedule."""
    time_limit: float = Field(DEFAULTS.time_limit, gt=0)
    """Seconds the ILP solver may take per mesh (it returns its best plan so far)."""
    solver_seed: int = DEFAULTS.solver_seed
    """The ILP solver's random seed (plans are deterministic for a seed)."""
    workers: int = Field(DEFAULTS.workers, ge=1)
    """Solver threads (1 keeps plans deterministic)."""
    remat: bool | Literal["auto"] = DEFAULTS.remat
    """Rematerialize the layers of a scan (the backward pass recomputes each from its input):
    auto (only where no plan of the step as written fits the memory budget), true, false; see
    shardplan.SearchOptions.remat."""
    grad_accumulation: Annotated[int, Field(ge=1)] | Literal["auto"] = DEFAULTS.grad_accumulation
    """Micro-batches whose gradients are summed before one update: auto or a count (1: never);
    see shardplan.SearchOptions.grad_accumulation."""
    model_constraints: Literal["hint", "ignore"] = DEFAULTS.model_constraints
    """The model's own sharding constraints: hint or ignore (SearchOptions.model_constraints)."""
    measure: bool = True
    """Compile the searched plan and the expert plans with XLA on CPU devices, price each
    with the cluster's profile and keep the cheapest that fits (meshes of at most 64
    devices; on larger ones the cost model decides alone)."""
    hints: dict[str, list[str | list[str] | None] | None] = Field(default_factory=dict)
    """Shardings to pin, the planner choosing the rest: input path pattern -> one mesh axis
    (a list of axes, or null) per dimension, first match wins, e.g. `"0/params/**/kernel":
    [null, model]`, `"2/**": [data]`; null pins replicated. Paths are '/'-joined, argument
    index first; `*` is one component, `**` any number. A pattern matching no input is an
    error. One program only: not with pipeline: true."""
    logical_axis_rules: list[tuple[str, str | list[str] | None]] = Field(default_factory=list)
    """(logical name, mesh axis or null) pairs for parameters that carry logical axis names
    (flax nn.with_logical_partitioning, nnx.with_partitioning), first match wins, e.g.
    `[[batch, data], [mlp, model], [embed, null]]`; hints may name logical axes too."""

    @field_validator("pipeline", mode="before")
    @classmethod
    def _pipeline(cls, value):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"  # a quoted "true" / "false"
        if isinstance(value, str) and value.lower() in ("auto", "spmd", "mpmd"):
            return value.lower()
        raise ValueError(f"must be true, false, auto, spmd or mpmd, got {value!r}")

    @model_validator(mode="after")
    def _hints_one_program(self):
        if self.hints and self.pipeline in (True, "spmd", "mpmd"):
            raise ValueError("hints pin the shardings of one program: set pipeline to auto "
                             "or false, or drop the hints")
        return self

    def to_hints(self) -> Hints:
        """The hints and logical axis rules as shardplan.Hints."""
        return Hints(self.hints, logical_axis_rules=self.logical_axis_rules)


class OutputSection(_Section):
    """What to write and compare."""

    dir: str = "shardplan-out"
    """Directory for plan.json, report.md and plots (the CLI's --out wins)."""
    formats: tuple[Literal["json", "md", "png"], ...] = FORMATS
    """What to write: json (the plan), md (report.md), png (plots in the report)."""
    compare: bool = True
    """Compile the plan and the baselines with XLA on CPU devices and price them (meshes of at
    most 64 devices; larger ones show the cost model's estimate only)."""
    baselines: tuple[Literal["data_parallel", "fsdp", "megatron", "two_d", "maxtext"], ...] | None = None
    """Baselines to compare with; default those that apply to the model and mesh. maxtext is
    MaxText's configuration: FSDP over the whole slice with the scanned layers
    rematerialized (its remat_policy full), for a step with scanned layers."""


class Config(_Section):
    """One planning job: a model on a cluster."""

    model: ModelSection
    """The train step to plan."""
    cluster: ClusterSection
    """The hardware, mesh and memory budget."""
    search: SearchSection = SearchSection()
    """Search options."""
    output: OutputSection = OutputSection()
    """Outputs and comparisons."""
    description: str = ""
    """A line for reports and the bench table."""
    source: str | None = Field(None, exclude=True)
    """The file this config came from (set by load_config)."""

    def budget_bytes(self) -> int:
        """The memory budget per device: as given, else the hardware profile's memory."""
        if self.cluster.memory_budget is not None:
            return int(self.cluster.memory_budget)
        return int(self.profile().memory_bytes)

    def profile(self) -> HardwareProfile:
        """The HardwareProfile of `cluster.hardware` (a path relative to the config's file)."""
        return get_profile(_resolve(self.cluster.hardware, self.source))

    def search_options(self) -> SearchOptions:
        """The search section and the memory budget as SearchOptions."""
        s = self.search
        return SearchOptions(memory_budget=self.budget_bytes(), time_limit=s.time_limit,
                             solver_seed=s.solver_seed, workers=s.workers, pipeline=s.pipeline,
                             num_micro_batches=s.num_micro_batches, schedule=s.schedule,
                             measure=s.measure, hints=s.to_hints(), remat=s.remat,
                             grad_accumulation=s.grad_accumulation,
                             model_constraints=s.model_constraints)


def _resolve(hardware: str, source: str | None) -> str:
    if hardware.endswith((".yaml", ".yml")) and not os.path.isabs(hardware) and source:
        return os.path.join(os.path.dirname(os.path.abspath(source)), hardware)
    return hardware


# -- loading --------------------------------------------------------------------------------


def apply_overrides(data: Mapping, overrides: Sequence[str]) -> dict:
    """A copy of `data` with each "dotted.key=value" set (value parsed as YAML)."""
    out = _deep_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError("--set", f"{item!r} is not of the form key.path=value "
                              "(e.g. --set model.size=gpt2-1.5b)")
        try:
            value = files.parse_yaml(raw, "--set value") if raw.strip() else None
        except files.FileError as e:
            raise ConfigError(key, f"cannot read the value {raw!r} of --set as YAML: {e}") from None
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(".".join(parts[: i + 1]), f"is {child!r}, not a mapping: cannot "
                                  f"set {key}")
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(x):
    if isinstance(x, Mapping):
        return {k: _deep_copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deep_copy(v) for v in x]
    return x


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Config:
    """Read, override, validate: a Config, or a ConfigError naming the key."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(None, f"config file {path!r} does not exist")
    try:
        data = files.load_yaml(path, "config")
    except files.FileError as e:
        raise ConfigError(None, e.what, source=path) from None
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(None, "must hold a mapping with the sections model, cluster, search, "
                          "output", source=path)
    return parse_config(apply_overrides(data, overrides), source=path)


def parse_config(data: Mapping, source: str | None = None) -> Config:
    """Validate plain data (as read from YAML) into a Config."""
    if "source" in data:
        raise ConfigError("source", "unknown key; allowed keys: "
                          + ", ".join(k for k in Config.model_fields if k != "source"), source)
    try:
        config = Config.model_validate({**data, "source": source})
    except pydantic.ValidationError as e:
        raise ConfigError(*_describe(e), source=source) from None
    try:
        _check_domain(config)
    except ConfigError as e:
        raise ConfigError(e.key, e.message, source) from None
    return config


def _dotted(loc: Sequence) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _section_at(loc: Sequence) -> type[BaseModel] | None:
    """The model class that the key at `loc` sits in (for listing the allowed keys)."""
    cls: Any = Config
    for part in loc:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        ann = field.annotation
        args = getattr(ann, "__args__", ()) or (ann,)
        nxt = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if not nxt:
            return None
        cls = nxt[0]
    return cls


def _describe(e: pydantic.ValidationError) -> tuple[str | None, str]:
    """(dotted key, message) of each validation error, joined: unknown keys list the allowed
    ones; bad values say what was given and what is allowed."""
    keys, lines = [], []
    for err in e.errors():
        loc = tuple(err["loc"])
        kind = err["type"]
        key = _dotted(loc) or None
        if kind == "extra_forbidden":
            parent = _section_at(loc[:-1])
            allowed = [k for k in (parent.model_fields if parent else ()) if k != "source"]
            msg = f"unknown key; allowed keys{' in ' + _dotted(loc[:-1]) if loc[:-1] else ''}: " \
                  f"{', '.join(allowed)}"
        elif kind == "missing":
            msg = "is required"
        else:
            text = err["msg"].removeprefix("Value error, ")
            msg = f"{text} (got {err['input']!r})" if kind != "value_error" else text
        keys.append(key)
        lines.append(f"{key}: {msg}" if key else msg)
    if len(lines) == 1:
        return keys[0], lines[0].split(": ", 1)[1] if keys[0] else lines[0]
    return None, "invalid config:\n  " + "\n  ".join(lines)


def _check_domain(config: Config) -> None:
    """What the schema cannot know: zoo models, sizes and fields; hardware profiles."""
    m = config.model
    if m.name is not None:
        known = models.list_models()
        if m.name not in known:
            raise ConfigError("model.name", f"unknown model {m.name!r}; known: {', '.join(known)}")
        sizes = models.list_sizes(m.name)
        if m.size.lower() not in sizes:
            raise ConfigError("model.size", f"model {m.name!r} has no size {m.size!r}; known "
                              f"sizes: {', '.join(sizes)}")
        base = models.get_config(m.name, m.size)
        fields = sorted(f.name for f in dataclasses.fields(base))
        for key in ("batch_size", "seq_len", "dtype"):
            if getattr(m, key) is not None and key not in fields:
                raise ConfigError(f"model.{key}", f"model {m.name!r} has no {key}; its config "
                                  f"fields: {', '.join(fields)}")
        for key, value in m.overrides.items():
            if key not in fields:
                raise ConfigError(f"model.overrides.{key}", f"model {m.name!r} has no config "
                                  f"field {key!r}; its fields: {', '.join(fields)}")
            if key in ("batch_size", "seq_len", "dtype"):
                raise ConfigError(f"model.overrides.{key}", f"set it as model.{key}")
            current = getattr(base, key)
            if current is not None and not _same_kind(current, value):
                raise ConfigError(f"model.overrides.{key}", f"expected a value like {current!r} "
                                  f"({type(current).__name__}), got {value!r}")
    try:
        hw = config.profile()
    except (ValueError, FileNotFoundError, TypeError) as e:
        raise ConfigError("cluster.hardware", str(e)) from None
    budget = config.cluster.memory_budget
    if budget is not None and budget > 64 * hw.memory_bytes:
        raise ConfigError("cluster.memory_budget", f"{budget} bytes is more than 64x the "
                          f"{hw.name} memory per device: give bytes per device, e.g. '16GiB'")


def _same_kind(current, value) -> bool:
    if isinstance(current, bool):
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if isinstance(current, int):
        return isinstance(value, int)
    if isinstance(current, float):
        return isinstance(value, (int, float))
    if isinstance(current, tuple):
        return isinstance(value, (list, tuple))
    return isinstance(value, type(current))
