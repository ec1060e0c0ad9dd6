"""Comments and docstrings in shardplan/ state what holds, not what a session measured.

A timing quoted in a comment ("took 154 s here (loaded machine)", "GPipe 1.48 s -> 1.09 s",
"was 1.257, now 0.98") is true of one machine on one day; the rule it stood for belongs in
the comment with the test that shows it, the figure in the docstring of the benchmark that
measures it (benchmarks/*.py) or in a commit message. Unit docs ("seconds per step",
"time_limit (seconds)", "1.5 ms" as an example of a string read) are not quotes.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "shardplan"

# Not yet cleaned: a path here only while its module is being restructured and its comments
# cleaned with it. Remove an entry once it passes.
PENDING: set[str] = set()

_NUMBER = r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?"
# a duration: a number and a unit of time, the unit perhaps qualified ("11.7 CPU s")
_TIME = (_NUMBER + r"\s*(?:(?:CPU|wall|wall-clock)\s+)?"
         r"(?:s|ms|us|µs|ns|sec|secs|seconds?|mins?|minutes?|h|hours?)(?![\w])")
# a figure of any kind: a duration, a ratio ("1.57x"), a share ("12%") or a size
_FIGURE = (r"(?:" + _TIME + r"|" + _NUMBER + r"\s*(?:x(?![\w])|%|[KMGT]i?B\b))")
_CLAUSE = r"(?:[^.;:]|\.(?=\d))"  # within one clause (a decimal point does not end it)

PATTERNS = {
    "a duration something took": re.compile(
        r"\b(?:took|takes|taking|ran|spent|lasted|in about|in under)\b" + _CLAUSE + r"{0,40}?"
        + _TIME, re.IGNORECASE),
    "a figure of this machine or this moment": re.compile(
        _FIGURE + _CLAUSE + r"{0,30}?\b(?:here|on this machine|loaded|before this|"
        r"before the fix|before it|previously|now)\b", re.IGNORECASE),
    "a figure before and after": re.compile(
        _FIGURE + r"\s*(?:->|→|=>|\bto\b)\s*" + _FIGURE, re.IGNORECASE),
    "was ... now": re.compile(r"\bwas\b" + _CLAUSE + r"{0,60}?\d" + _CLAUSE
                              + r"{0,60}?\bnow\b", re.IGNORECASE),
    "faster or slower by a factor": re.compile(
        _NUMBER + r"(?:\s*-\s*" + _NUMBER + r")?\s*x\s+(?:faster|slower)\b", re.IGNORECASE),
    "a measured duration": re.compile(
        r"\bmeasured\b" + _CLAUSE + r"{0,60}?" + _TIME + r"|" + _TIME + _CLAUSE
        + r"{0,60}?\bmeasured\b", re.IGNORECASE),
    "the machine or session it was seen on": re.compile(
        r"\bloaded machine\b|"
        r"\b(?:this|last|earlier|previous)\s+session\b|\bsession\s+\d+", re.IGNORECASE),
}


def _pending(rel: str) -> bool:
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in PENDING)


def _docstrings(tree: ast.AST):
    """(line, text) of every string statement: docstrings of modules, classes and functions,
    and the attribute docstrings under fields and constants."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for stmt in body if isinstance(body, list) else []:
            if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)):
                yield stmt.lineno, stmt.value.value


def _comments(source: str):
    """(line, text) of every run of comment lines on consecutive lines, joined."""
    run: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        if run and tok.start[0] != run[-1][0] + 1:
            yield run[0][0], " ".join(t for _, t in run)
            run = []
        run.append((tok.start[0], tok.string.lstrip("#").strip()))
    if run:
        yield run[0][0], " ".join(t for _, t in run)


def quotes(text: str) -> list[tuple[str, str]]:
    """(pattern name, matched text) of every timing or session figure `text` quotes."""
    flat = " ".join(text.split())
    return [(name, m.group(0)) for name, pattern in PATTERNS.items()
            for m in pattern.finditer(flat)]


def found_in(path: pathlib.Path) -> list[str]:
    source = path.read_text(encoding="utf-8")
    rel = path.relative_to(ROOT).as_posix()
    texts = [*_docstrings(ast.parse(source)), *_comments(source)]
    return [f"{rel}:{line}: {name}: {quote!r}"
            for line, text in sorted(texts) for name, quote in quotes(text)]


def _modules(pending: bool) -> list[pathlib.Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if _pending(p.relative_to(ROOT).as_posix()) == pending]


@pytest.mark.parametrize("text", [
    "Compiling a 48-layer step took 154 s for one candidate here (loaded machine)",
    "the CLI took over 540 s",
    "GPT 6.7B on 8x8, compiled and priced: GPipe 1.48 s -> 1.09 s",
    "the estimate was 1.257, now 0.98",
    "measured: GPT-2 1.5B on 8 A100s, 1.57x before this stage",
    "ten full collections took 2.0 of 11.7 CPU s (measured with gc.callbacks)",
    "and make compiling about 1.5-3x faster",
    "which took 12 minutes on this machine",
    "(2026-11-27, session 16)",
])
def test_a_quoted_timing_is_found(text):
    assert quotes(text)


@pytest.mark.parametrize("text", [
    "Seconds per step of the plan, compute plus communication.",
    "time_limit (seconds): the wall clock a whole search must end by.",
    'Bytes and seconds as people write them: "16GiB", "500 MB", 2**30; "1.5 ms".',
    "Seconds an interrupt has to unwind before the process exits.",
    ".inf flops would price every step at 0 s (tests/test_hardening.py)",
    "The compiler charges each custom call -1 second; they are added back here.",
    "bytes per device (an int or a string like \"16GiB\"); the step runs 2 s per tick",
    "the planner's session (several micro-batch counts, the final stages)",
    "Measure the devices of `mesh` and return the profile the planner would use for this machine.",
    "1F1B: M + 2S - 2 ticks of a forward slot then a backward slot",
])
def test_a_unit_doc_is_not_a_quote(text):
    assert not quotes(text)


def test_no_comment_or_docstring_quotes_a_timing():
    found = [line for path in _modules(pending=False) for line in found_in(path)]
    assert not found, ("comments that quote a timing or a session's figure (state what "
                       "holds and name the test or benchmark that shows it):\n"
                       + "\n".join(found))


def test_every_pending_path_exists():
    """An entry left in PENDING after its module moved would exempt nothing: remove it."""
    for entry in PENDING:
        assert (ROOT / entry).exists(), f"{entry} is pending but does not exist"
