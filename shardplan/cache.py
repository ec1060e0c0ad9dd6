"""The plan cache: plans on disk keyed by the step's fingerprint (shardplan.fingerprint) and
the version of shardplan, so a restarted job does not plan again.

The directory is `$SHARDPLAN_CACHE`, else `~/.cache/shardplan`; `SHARDPLAN_CACHE=off`
disables it. One JSON file per fingerprint, written to a temporary file and renamed, so a
reader never sees half a plan. An entry that cannot be read, or was written by another
version of shardplan (whose planner may decide differently), is ignored with a warning and
replaced by the next plan.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib
import tempfile
import warnings
from collections.abc import Callable

from shardplan.plan import FORMAT_VERSION, Plan

ENV = "SHARDPLAN_CACHE"
DISABLED = ("", "0", "off", "false", "none")


class StaleCacheWarning(UserWarning):
    """A cache entry was ignored: unreadable, or written by another version of shardplan."""


@functools.lru_cache(maxsize=1)
def version() -> str:
    """The shardplan version and a digest of its source: plans of a changed planner are not
    reused, even in a development install whose version number did not move."""
    try:
        release = importlib.metadata.version("shardplan")
    except importlib.metadata.PackageNotFoundError:
        release = "unknown"
    root = pathlib.Path(__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return f"{release}+{h.hexdigest()[:12]}"


def default_dir() -> pathlib.Path | None:
    """`$SHARDPLAN_CACHE`, else ~/.cache/shardplan; None if the variable disables the cache."""
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in DISABLED else pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "shardplan"


@dataclasses.dataclass(frozen=True)
class PlanCache:
    """Plans in `directory`, one file per step fingerprint."""

    directory: pathlib.Path

    @classmethod
    def of(cls, option: bool | str | os.PathLike | PlanCache | None) -> PlanCache | None:
        """The cache an `auto(cache=...)` option names: True (the default directory), False or
        None (no cache), a directory, or a PlanCache."""
        if isinstance(option, PlanCache):
            return option
        if option is True:
            d = default_dir()
            return None if d is None else cls(d)
        if option is False or option is None:
            return None
        return cls(pathlib.Path(option).expanduser())

    def path(self, fingerprint: str) -> pathlib.Path:
        return self.directory / f"plan-{fingerprint[:40]}.json"

    def load(self, fingerprint: str) -> Plan | None:
        """The cached plan of `fingerprint`, or None (missing, unreadable or stale: warned)."""
        path = self.path(fingerprint)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            return _ignore(path, f"it cannot be read ({e})")
        try:
            entry = json.loads(text)
            written_by = entry["shardplan"]
            if written_by != version():
                return _ignore(path, f"it was planned by shardplan {written_by}, this is "
                                     f"{version()}")
            if entry["fingerprint"] != fingerprint:
                return _ignore(path, "it holds the plan of another step")
            return Plan.from_dict(entry["plan"])
        except (ValueError, KeyError, TypeError) as e:
            return _ignore(path, f"it is not a plan this version reads ({type(e).__name__}: "
                                 f"{str(e)[:200]})")

    def store(self, fingerprint: str, plan: Plan) -> pathlib.Path | None:
        """Write `plan` under `fingerprint` atomically; a failure to write is a warning, not an
        error (the job runs on without a cache). Returns the path written, or None."""
        if plan.stages and plan.pipeline_kind != "spmd":
            return None  # an MPMD plan is rebuilt by the pipeline planner, not from JSON
        entry = {"shardplan": version(), "format": FORMAT_VERSION, "fingerprint": fingerprint,
                 "plan": plan.to_dict()}
        path = self.path(fingerprint)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".plan-", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(entry, f)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            warnings.warn(f"shardplan: could not write the plan cache entry {path} ({e}); "
                          f"set {ENV} to a writable directory, or pass cache=False",
                          StaleCacheWarning, stacklevel=3)
            return None
        return path

    def get_or_plan(self, fingerprint: str, plan_fn: Callable[[], Plan]) -> Plan:
        """The cached plan of `fingerprint`, else `plan_fn()` stored under it."""
        plan = self.load(fingerprint)
        if plan is None:
            plan = plan_fn()
            self.store(fingerprint, plan)
        return plan


def cached(option, fingerprint: str, plan_fn: Callable[[], Plan]) -> Plan:
    """`plan_fn()` through the cache an `auto(cache=...)` option names (no cache: just
    `plan_fn()`)."""
    cache = PlanCache.of(option)
    return plan_fn() if cache is None else cache.get_or_plan(fingerprint, plan_fn)


def _ignore(path: pathlib.Path, why: str) -> None:
    warnings.warn(f"shardplan: ignoring the plan cache entry {path}: {why}; planning again "
                  "(the entry will be replaced)", StaleCacheWarning, stacklevel=4)
