"""The plan cache: plans on disk keyed by the step fingerprint (shardplan.fingerprint
.step_fingerprint: every input that changes the plan, the versions of jax and shardplan
included), so a restarted job does not plan again.

The directory is `$SHARDPLAN_CACHE`, else `~/.cache/shardplan`; `SHARDPLAN_CACHE=off`
disables it. It is created private to the user (0o700); an existing one that another user
owns, or that others may write, is not used (a warning says so): another local user could
plant entries there. One JSON file per fingerprint (0o600), written to a temporary file in the
directory and renamed, so a reader never sees half a plan. An entry is read like any file
from disk (shardplan.files: a regular file, size and depth bounded, strict JSON) and checked
whole: its fields, its version of shardplan, its fingerprint, the plan's schema, and (by the
caller) that the plan applies to the step. An entry that fails any check is ignored with one
warning and replaced by the next plan. Shown by tests/test_cache.py and
tests/test_cache_hardening.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import stat
import tempfile
import warnings
from collections.abc import Callable

from shardplan import files
from shardplan.fingerprint import shardplan_version
from shardplan.plan import FORMAT_VERSION, Plan
from shardplan.plan_file import PlanFileError, plan_from_dict

ENV = "SHARDPLAN_CACHE"
DISABLED = ("", "0", "off", "false", "none")
ENTRY_KEYS = ("shardplan", "format", "fingerprint", "plan")


class StaleCacheWarning(UserWarning):
    """A cache entry was ignored (unreadable, of another version, or wrong), or the cache
    directory is not safe to use."""


def version() -> str:
    """The shardplan version and a digest of its source (shardplan.fingerprint)."""
    return shardplan_version()


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
        """The cached plan of `fingerprint`, or None: missing, or failing a check (warned
        once), or the directory is not safe to use (warned)."""
        if not self._safe_directory(create=False):
            return None
        path = self.path(fingerprint)
        try:
            entry = files.load_json(path, what="plan cache entry")
        except FileNotFoundError:
            return None
        except files.FileError as e:
            return self.discard(fingerprint, e.what)
        if not isinstance(entry, dict) or sorted(entry) != sorted(ENTRY_KEYS):
            return self.discard(fingerprint, "it is not a plan cache entry (its fields should "
                                f"be {', '.join(ENTRY_KEYS)})")
        written_by = entry["shardplan"]
        if written_by != version():
            return self.discard(fingerprint, f"it was planned by shardplan "
                                f"{files.printable(written_by)[:60]}, this is {version()}")
        if entry["fingerprint"] != fingerprint:
            return self.discard(fingerprint, "it holds the plan of another step")
        if entry["format"] != FORMAT_VERSION or type(entry["format"]) is not int:
            return self.discard(fingerprint, f"its format is not {FORMAT_VERSION}")
        try:
            return plan_from_dict(entry["plan"], path)
        except PlanFileError as e:
            return self.discard(fingerprint, f"it is not a plan this version reads: {e.what}")

    def discard(self, fingerprint: str, why: str) -> None:
        """Warn (once) that the entry of `fingerprint` is ignored because `why`; the next
        plan stored replaces it. Returns None, for `return cache.discard(...)`."""
        warnings.warn(f"shardplan: ignoring the plan cache entry {self.path(fingerprint)}: "
                      f"{why}; planning again (the entry will be replaced)", StaleCacheWarning,
                      stacklevel=3)

    def store(self, fingerprint: str, plan: Plan) -> pathlib.Path | None:
        """Write `plan` under `fingerprint` atomically (a private temporary file in the
        directory, renamed); a failure to write is a warning, not an error (the job runs on
        without a cache). Returns the path written, or None."""
        if plan.stages and plan.pipeline_kind != "spmd":
            return None  # an MPMD plan is rebuilt by the pipeline planner, not from JSON
        if not self._safe_directory(create=True):
            return None
        entry = {"shardplan": version(), "format": FORMAT_VERSION, "fingerprint": fingerprint,
                 "plan": plan.to_dict()}
        path = self.path(fingerprint)
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".plan-", suffix=".tmp")
            try:
                os.fchmod(fd, 0o600)  # mkstemp's mode already; said here as the contract
                with os.fdopen(fd, "w") as f:
                    json.dump(entry, f, allow_nan=False)  # as files.load_json reads it
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except (OSError, ValueError) as e:  # ValueError: a NaN in the plan
            warnings.warn(f"shardplan: could not write the plan cache entry {path} ({e}); "
                          f"set {ENV} to a writable directory, or pass cache=False",
                          StaleCacheWarning, stacklevel=3)
            return None
        return path

    def _safe_directory(self, *, create: bool) -> bool:
        """Whether the directory may be used: created 0o700 if `create` and missing; an
        existing one must be a directory the user owns that no one else may write."""
        d = self.directory
        try:
            if create:
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = d.stat()
        except FileNotFoundError:
            return False
        except OSError as e:
            _warn_unsafe(f"shardplan: cannot use the plan cache directory {d} ({e}); set {ENV} "
                       "to a directory of yours, or pass cache=False")
            return False
        why = ("it is not a directory" if not stat.S_ISDIR(st.st_mode) else
               "another user owns it" if hasattr(os, "getuid") and st.st_uid != os.getuid() else
               "other users may write to it" if st.st_mode & 0o022 else "")
        if why:
            _warn_unsafe(f"shardplan: not using the plan cache directory {d}: {why}, so another "
                       f"user could plant plans there; set {ENV} to a directory only you may "
                       f"write (e.g. ~/.cache/shardplan, created 0o700), or pass cache=False")
            return False
        return True

    def lookup(self, fingerprint: str,
               check: Callable[[Plan], object] | None = None) -> Plan | None:
        """The cached plan of `fingerprint`, or None. `check(plan)` raising ValueError says a
        cached plan does not apply to the step: the entry is then discarded with a warning
        (the caller plans and stores the plan that replaces it)."""
        plan = self.load(fingerprint)
        if plan is not None and check is not None:
            try:
                check(plan)
            except ValueError as e:
                plan = self.discard(fingerprint, f"its plan does not apply to this step ({e})")
        return plan


def _warn_unsafe(message: str) -> None:
    """Warn of an unsafe directory; Python's warning registry shows a message once per
    place, so not at every step."""
    warnings.warn(message, StaleCacheWarning, stacklevel=4)
