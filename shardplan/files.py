"""Reading what comes from disk: plan files, cache entries, configs and hardware profiles.

Nothing read is trusted. Only regular files are opened (a FIFO would hang the reader, a
symlink to /dev/zero would read until memory runs out), their size is bounded, JSON is parsed
strictly (no duplicate keys, no NaN or Infinity, nesting depth bounded before the parser
recurses) and YAML is loaded with PyYAML's safe loader with its aliases and the size they
expand to bounded (a 535-byte alias bomb fails at once). Every failure is a FileError naming
the file and what is wrong. `printable` makes text from a file safe to print to a terminal.
Shown by tests/test_files.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import unicodedata
from typing import Any

import yaml

MAX_BYTES = 64 * 2**20
"""Largest plan file or cache entry read (the largest zoo plan is well under 1 MiB)."""
MAX_YAML_BYTES = 4 * 2**20
"""Largest config or hardware profile read."""
MAX_DEPTH = 64
"""Deepest nesting of JSON arrays and objects read (a plan file nests 6 deep)."""
MAX_ALIASES = 100
"""Most YAML aliases (`*name`) in one document."""
MAX_YAML_NODES = 100_000
"""Most YAML nodes one document may stand for once its aliases are expanded."""


class FileError(ValueError):
    """A file that cannot be read as what it should be: `path` and what is wrong with it."""

    def __init__(self, path, what: str):
        super().__init__(f"{path}: {what}")
        self.path, self.what = path, what


# -- bytes ----------------------------------------------------------------------------------


def read_text(path, *, what: str = "file", max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of the regular file `path` (a symlink to one is followed), at most
    `max_bytes` long. FileNotFoundError if there is none; FileError for a directory, FIFO,
    device or socket (checked before opening and again on the open file), a file too large,
    or bytes that are not UTF-8."""
    fspath = os.fspath(path)
    try:
        if not stat.S_ISREG(os.stat(fspath).st_mode):
            raise FileError(path, f"the {what} is not a regular file ({_kind(fspath)}); "
                            "give the path of a file")
        # O_NONBLOCK: a FIFO swapped in after the check above must not block the open
        fd = os.open(fspath, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) |
                     getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise FileError(path, f"the {what} cannot be opened ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise FileError(path, f"the {what} is not a regular file; give the path of a file")
        if st.st_size > max_bytes:
            raise FileError(path, _too_large(what, st.st_size, max_bytes))
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew while being read
        raise FileError(path, _too_large(what, len(data), max_bytes))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileError(path, f"the {what} is not UTF-8 text (byte {e.start}): is it the "
                        "right file?") from None


def _kind(path: str) -> str:
    mode = os.stat(path).st_mode
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _too_large(what: str, size: int, limit: int) -> str:
    return (f"the {what} is {size} bytes, more than the {limit} bytes read; it is not one "
            "shardplan wrote")


# -- JSON -----------------------------------------------------------------------------------


def load_json(path, *, what: str = "file", max_bytes: int = MAX_BYTES,
              max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of the regular file `path`, strictly parsed (see parse_json)."""
    return parse_json(read_text(path, what=what, max_bytes=max_bytes), path, what=what,
                      max_depth=max_depth)


# a JSON string (skipped whole, so brackets inside it do not count) or a bracket
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


def parse_json(text: str, path="<text>", *, what: str = "file",
               max_depth: int = MAX_DEPTH) -> Any:
    """`text` as JSON: FileError for invalid JSON, nesting deeper than `max_depth` (checked
    before parsing, so the parser never recurses deeply), duplicate keys in an object, NaN,
    Infinity or numbers that overflow to them, and integers of more than 20 digits."""
    depth = 0
    for m in _TOKENS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > max_depth:
                raise FileError(path, f"the {what} nests arrays and objects more than "
                                f"{max_depth} deep (at character {m.start()}); it is not one "
                                "shardplan wrote")
        elif c in "]}":
            depth -= 1
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant,
                          parse_float=_finite_float, parse_int=_bounded_int)
    except _Rejected as e:
        raise FileError(path, f"the {what} {e}") from None
    except RecursionError:  # unreachable past the depth scan; kept as a FileError all the same
        raise FileError(path, f"the {what} nests too deeply") from None
    except json.JSONDecodeError as e:
        raise FileError(path, f"the {what} is not valid JSON ({e}); it may be truncated") \
            from None


class _Rejected(ValueError):
    pass


def _unique_keys(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise _Rejected(f"has the key {k!r} twice in one object")
        d[k] = v
    return d


def _no_constant(name: str):
    raise _Rejected(f"holds {name}, which is not a number JSON allows (finite numbers only)")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise _Rejected(f"holds the number {text[:40]}, which is out of range (finite numbers "
                        "only)")
    return x


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 20:
        raise _Rejected(f"holds the integer {text[:40]}... of {len(text)} digits; no count or "
                        "size in a shardplan file is that large")
    return int(text)


_ASCII_INT = re.compile(r"-?[0-9]+", re.ASCII)


def ascii_int(text: str) -> int | None:
    """The integer `text` spells in ASCII digits (an optional leading '-'), else None: '٣',
    ' 3', '3_000' and '+3' are not integers here, as int() would take them."""
    if not isinstance(text, str) or not _ASCII_INT.fullmatch(text) or len(text) > 20:
        return None
    return int(text)


# -- YAML -----------------------------------------------------------------------------------


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader counting aliases as it composes, and refusing a document whose
    nodes, once aliases are expanded, would number more than MAX_YAML_NODES: aliases share
    nodes, so the document loads small, but anything that walks it (a deep copy, validation)
    would walk the expansion."""

    def __init__(self, stream):
        super().__init__(stream)
        self.aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise _Rejected(f"uses more than {MAX_ALIASES} YAML aliases (*name); write the "
                                "values out")
        return super().compose_node(parent, index)

    def compose_document(self):
        node = super().compose_document()
        if self.aliases and _expanded_size(node) > MAX_YAML_NODES:
            raise _Rejected(f"stands for more than {MAX_YAML_NODES} values once its YAML "
                            "aliases are expanded (an alias bomb?)")
        return node


def _expanded_size(root) -> int:
    """How many nodes the node graph under `root` stands for with every alias expanded;
    linear in the graph (a shared node is sized once), capped just past MAX_YAML_NODES;
    a recursive alias is refused."""
    sizes: dict[int, int] = {}
    ancestors: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        children = _children(node)
        if done:
            ancestors.discard(id(node))
            sizes[id(node)] = min(1 + sum(sizes[id(c)] for c in children),
                                  MAX_YAML_NODES + 1)
        elif id(node) in ancestors:
            raise _Rejected("holds a YAML alias to a value that contains it (a recursive "
                            "alias); write the values out")
        elif id(node) not in sizes:
            ancestors.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in children)
    return sizes[id(root)]


def _children(node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [c for pair in node.value for c in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def load_yaml(path, what: str, *, max_bytes: int = MAX_YAML_BYTES) -> Any:
    """The YAML document in the regular file `path`, loaded safely (plain values only) with
    aliases bounded. FileNotFoundError if there is none; FileError (a ValueError naming the
    file) for anything else wrong, a syntax error included."""
    return parse_yaml(read_text(path, what=what, max_bytes=max_bytes), what, path=path)


def parse_yaml(text: str, what: str, *, path="<text>") -> Any:
    """`text` as one YAML document, as load_yaml reads it."""
    try:
        loader = _BoundedLoader(text)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except _Rejected as e:
        raise FileError(path, f"the {what} {e}") from None
    except RecursionError:
        raise FileError(path, f"the {what} nests too deeply") from None
    except yaml.YAMLError as e:
        raise FileError(path, f"the {what} is not valid YAML: {e}") from None
    except ValueError as e:  # an integer past Python's digit limit, a bad timestamp
        raise FileError(path, f"the {what} holds a value YAML cannot read: {e}") from None


# -- text for a terminal --------------------------------------------------------------------


def printable(text: Any, *, keep: str = "\n") -> str:
    """`text` with every control character (ESC, BEL, the C1 controls, bidirectional
    overrides; those in `keep` aside) shown as its escape (`\\x1b`), so text from a file
    cannot move the cursor, clear the screen, set a hyperlink or write the clipboard."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c in keep or c == " " or not _control(c) else
                   f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}" for c in text)


def _control(c: str) -> bool:
    return unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn")
