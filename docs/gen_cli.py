"""Write the generated parts of docs/cli.md: each command's `--help`, and the config reference
from the pydantic schema in shardplan/config.py (field types, defaults and docstrings).

    python docs/gen_cli.py          # rewrite the generated parts of docs/cli.md
    python docs/gen_cli.py --check  # exit 1 if they are not what this script writes

The generated parts sit between `<!-- BEGIN GENERATED: name -->` and `<!-- END GENERATED:
name -->` lines; the prose around them is written by hand. tests/test_docs.py runs the check.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import sys
import typing

HERE = pathlib.Path(__file__).resolve().parent
TARGET = HERE / "cli.md"
COMMANDS = ("search", "bench", "show", "profile")
HELP_WIDTH = "100"


def command_help() -> str:
    """`shardplan --help` and `shardplan COMMAND --help` for every command, as printed."""
    from shardplan import cli

    blocks = []
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH  # argparse wraps to the terminal's width
    try:
        for args in ([], *([c] for c in COMMANDS)):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                code = cli.main([*args, "--help"])
            assert code == 0, f"shardplan {' '.join(args)} --help exited {code}"
            title = f"shardplan {' '.join(args)} --help".replace("  ", " ")
            blocks += [f"### `{title}`", "", "```text", buf.getvalue().rstrip(), "```", ""]
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(blocks).rstrip()


def type_name(annotation) -> str:
    """A field's type as a YAML writer reads it."""
    from pydantic import BaseModel

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" if isinstance(a, str) else f"`{str(a).lower()}`"
                            for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        parts = [type_name(a) for a in args if a is not type(None)]
        text = " \\| ".join(parts)
        return text + (" \\| `null`" if type(None) in args else "")
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_name(args[0])}"
        return "list"
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping (below)"
    names = {bool: "bool", int: "int", float: "number", str: "string"}
    if annotation in names:
        return names[annotation]
    return getattr(annotation, "__name__", str(annotation))


def _default(field) -> str:
    from pydantic_core import PydanticUndefined

    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
    else:
        value = field.default
    if value is PydanticUndefined:
        return "required"
    if hasattr(value, "model_dump"):
        return "(below)"
    if value is None:
        return "`null`"
    if value == "":
        return '`""`'

    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return "`[" + ", ".join(map(str, value)) + "]`"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return re.sub(r"\s+", " ", text or "").strip().replace("|", "\\|")


def _sections(cls, key: str):
    """(dotted key, section class) of the config and every section nested in it, depth first."""
    from pydantic import BaseModel

    yield key, cls
    for name, field in cls.model_fields.items():
        if field.exclude:
            continue
        for a in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(a, type) and issubclass(a, BaseModel):
                yield from _sections(a, f"{key}.{name}" if key else name)


def config_reference() -> str:
    """A table per config section: key, type, default and the field's docstring."""
    from shardplan.config import Config

    out = []
    for key, cls in _sections(Config, ""):
        title = f"`{key}`" if key else "top level"
        out += [f"### {title}", "", _cell(cls.__doc__), "",
                "| key | type | default | meaning |", "|---|---|---|---|"]
        for name, field in cls.model_fields.items():
            if field.exclude:
                continue
            dotted = f"{key}.{name}" if key else name
            out.append(f"| `{dotted}` | {type_name(field.annotation)} | {_default(field)} | "
                       f"{_cell(field.description)} |")
        out.append("")
    return "\n".join(out).rstrip()


GENERATORS = {"commands": command_help, "config": config_reference}


def render(text: str) -> str:
    """`text` with every generated region replaced by what its generator writes now."""
    for name, gen in GENERATORS.items():
        pattern = re.compile(rf"(<!-- BEGIN GENERATED: {name} [^\n]*-->\n).*?"
                             rf"(<!-- END GENERATED: {name} -->)", re.DOTALL)
        if not pattern.search(text):
            raise SystemExit(f"{TARGET} has no generated region {name!r}")
        body = gen()
        text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
    return text


def main(argv: list[str]) -> int:
    current = TARGET.read_text()
    text = render(current)
    if "--check" in argv:
        if text != current:
            print(f"{TARGET} is stale: run python docs/gen_cli.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
