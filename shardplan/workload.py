"""The workload a config names: a zoo model at a size, or the user's `model.entry` function
(imported from the current directory or the config's), as a step with abstract arguments."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from shardplan import models
from shardplan.config import Config, ConfigError
from shardplan.ir.trace import abstractify

_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep


@dataclasses.dataclass(frozen=True)
class Workload:
    """The step to plan, with abstract args; `step` is set when it is a zoo-style TrainStep
    (the baselines need its state/batch layout)."""

    label: str
    fn: Any
    args: tuple
    state_argnums: tuple[int, ...] | None
    batch_argnums: tuple[int, ...] | None
    step: Any = None
    num_params: int = 0
    dtype: str = "float32"


def build_workload(config: Config) -> Workload:
    """The config's train step with ShapeDtypeStruct args (nothing allocated)."""
    m = config.model
    if m.name is not None:
        try:
            step = models.get_model(m.name, m.size, abstract=True, batch_size=m.batch_size,
                                    **m.zoo_overrides())
        except (ValueError, TypeError) as e:
            raise ConfigError("model", f"cannot build {m.label}: {e}", config.source) from None
    else:
        make = load_entry(m.entry, config.source)
        try:
            step = make(**m.kwargs)
        except Exception as e:  # noqa: BLE001 - the user's code: say where it failed
            raise ConfigError("model.entry", f"{m.entry}(**model.kwargs) raised "
                              f"{user_error(e)}", config.source) from None
    if isinstance(step, models.TrainStep):
        args = jax.tree.map(abstractify, step.args)
        dtype = m.dtype or str(getattr(step.config, "dtype", None) or "float32")
        step = dataclasses.replace(step, args=args)
        return Workload(m.label if m.name else step.name, step.fn, args, step.state_argnums,
                        step.batch_argnums, step, step.num_params, dtype)
    if isinstance(step, tuple) and len(step) == 2 and callable(step[0]):
        fn, args = step
        args = jax.tree.map(abstractify, tuple(args))
        n = sum(int(getattr(x, "size", 0)) for x in jax.tree.leaves(args))
        return Workload(m.label, fn, args, None, None, None, n, m.dtype or "float32")
    raise ConfigError("model.entry", f"{m.entry} returned {type(step).__name__}; return a "
                      "shardplan.models.TrainStep or a (fn, args) tuple", config.source)


@contextlib.contextmanager
def _importable_from(directories: Sequence[str]) -> Iterator[None]:
    """`directories` on sys.path (first) while the block runs."""
    added = [d for d in dict.fromkeys(directories) if d not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for d in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(d)


def load_entry(entry: str, source: str | None = None):
    """The object named by "package.module:function", imported from the current directory, the
    config file's directory (`source`'s), or sys.path (a console script's sys.path holds
    neither directory)."""
    module, _, attr = entry.partition(":")
    where = [os.getcwd()] + ([os.path.dirname(os.path.abspath(source))] if source else [])
    try:
        with _importable_from(where):
            obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        if isinstance(e, ImportError) and e.name != module.split(".")[0] and e.name != module:
            raise ConfigError("model.entry", f"importing {module!r} raised {user_error(e)}",
                              source) from None
        raise ConfigError("model.entry", f"cannot load {entry!r}: {e}; it must name a function "
                          "importable from the current directory, the config's directory or "
                          "PYTHONPATH", source) from None
    except Exception as e:  # noqa: BLE001 - the user's module raised while importing
        raise ConfigError("model.entry", f"importing {module!r} raised {user_error(e)}",
                          source) from None
    if not callable(obj):
        raise ConfigError("model.entry", f"{entry!r} is a {type(obj).__name__}, not a function",
                          source)
    return obj


def user_error(e: BaseException) -> str:
    """An exception raised in the user's code: its type, message and the user's own frames
    (those of shardplan, importlib and the standard library left out)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(_HERE) and "importlib" not in f.filename
              and not f.filename.startswith("<frozen")]
    where = "".join(traceback.format_list(frames)).rstrip()
    head = "".join(traceback.format_exception_only(type(e), e)).strip()
    return f"{head}\n{where}" if where else head
