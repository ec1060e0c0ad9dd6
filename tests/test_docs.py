"""The docs: the generated references match the code; every relative link in the README,
docs/ and the notebooks points at a file (and heading) inside the repository; every code block
of the README and docs/ runs on the 8 CPU devices, or says why it is not run."""

import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_generated_from_the_docstrings():
    gen = _load("gen_api")
    assert (DOCS / "api.md").read_text() == gen.render(), \
        "docs/api.md is stale: run `python docs/gen_api.py` and commit it"


def test_api_reference_covers_the_public_surface():
    import shardplan

    text = (DOCS / "api.md").read_text()
    for name in shardplan.__all__:
        assert f"`shardplan.{name}`" in text, name


def test_cli_reference_is_generated_from_the_schema_and_the_parser():
    gen = _load("gen_cli")
    current = (DOCS / "cli.md").read_text()
    assert current == gen.render(current), \
        "docs/cli.md is stale: run `python docs/gen_cli.py` and commit it"


def test_cli_reference_lists_every_config_key():
    from shardplan.config import Config

    text = (DOCS / "cli.md").read_text()
    gen = _load("gen_cli")
    for key, cls in gen._sections(Config, ""):
        for name, field in cls.model_fields.items():
            if not field.exclude:
                dotted = f"{key}.{name}" if key else name
                assert f"| `{dotted}` |" in text, dotted


def _markdown_sources():
    """(path, markdown text) of the README, every doc and every notebook's markdown cells."""
    yield ROOT / "README.md", (ROOT / "README.md").read_text()
    for path in sorted(DOCS.glob("*.md")):
        yield path, path.read_text()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        yield path, "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def _anchors(text: str) -> set[str]:
    """The ids GitHub gives the headings of a Markdown file (repeats get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _links():
    for path, text in _markdown_sources():
        text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # code blocks hold no links
        for target in LINK.findall(text):
            if not re.match(r"[a-z]+:", target):  # relative links only
                yield path, target


@pytest.mark.parametrize("source,target", [(str(p.relative_to(ROOT)), t) for p, t in _links()])
def test_relative_link_resolves_inside_the_repository(source, target):
    base = (ROOT / source).parent
    file_part, _, anchor = target.partition("#")
    dest = (base / file_part).resolve() if file_part else (ROOT / source)
    assert dest == ROOT or ROOT in dest.parents, f"{source} links outside the repository: {target}"
    assert dest.exists(), f"{source}: broken link {target}"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest.read_text()), f"{source}: no heading #{anchor} in {dest.name}"


def test_readme_points_to_nothing_outside_the_repository():
    text = (ROOT / "README.md").read_text()
    assert "shared/" not in text and "../" not in text
    for target in ("docs/", "notebooks/"):
        assert f"]({target}" in text, f"the README links to {target}"


def test_notebooks_name_no_host_but_colab_and_github():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        text = path.read_text()
        hosts = set(re.findall(r"https?://([^/\s\"')]+)", text))
        assert hosts <= {"colab.research.google.com", "github.com"}, (path.name, hosts)


# -- every code block runs, or says why not ---------------------------------------------------
#
# A fenced block of README.md or docs/*.md is one of:
# - python: executed, the blocks of one file in order in one namespace (SETUP[file] first: the
#   arrays and the step a page's fragments take as given), in a fresh directory. A block whose
#   first line names a file (`# mymodel.py`, `"""train.py: ...`) is written there instead;
# - yaml: a config (model + cluster) loaded by shardplan.config, else a hardware profile loaded
#   by get_profile; written to the file its first comment names, if any;
# - console / shell / no language: each `shardplan ...` line run through the CLI in-process
#   (with SMALL's overrides), `python X.py 0 & python X.py 1 & wait` run as two processes of
#   the file X.py an earlier block wrote, the lines after it compared with what process 0 prints;
# - generated (inside `<!-- BEGIN GENERATED ... -->`, or docs/api.md): checked against the code
#   by the generator tests above;
# - marked `<!-- not run: why -->` on the line before the fence.

FENCE = re.compile(r"^\s*```(\w*)\s*$")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(.+?)\s*-->\s*$")
FILE_NAME = re.compile(r'^(?:#|""")\s*([\w.-]+\.(?:py|yaml))\b')
SHELL = ("", "console", "shell", "sh", "bash")


@dataclasses.dataclass(frozen=True)
class Block:
    path: str
    line: int
    lang: str
    text: str
    not_run: str | None = None
    generated: bool = False

    @property
    def file_name(self) -> str | None:
        m = FILE_NAME.match(self.text.lstrip("\n"))
        return m.group(1) if m else None

    def commands(self) -> list[str]:
        return [ln.strip().removeprefix("$ ") for ln in self.text.splitlines()
                if ln.strip().removeprefix("$ ").startswith(("shardplan ", "python "))]

    @property
    def runs(self) -> bool:
        if self.not_run or self.generated:
            return False
        if self.lang in ("python", "yaml"):
            return True
        return self.lang in SHELL and bool(self.commands())

    def __str__(self):
        return f"{self.path}:{self.line}"


def doc_blocks(path: pathlib.Path) -> list[Block]:
    rel = str(path.relative_to(ROOT))
    out, lines = [], path.read_text().splitlines()
    generated = path.name == "api.md"
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("<!-- BEGIN GENERATED"):
            generated = True
        elif line.startswith("<!-- END GENERATED"):
            generated = path.name == "api.md"
        m = FENCE.match(line)
        if not m:
            i += 1
            continue
        lang = m.group(1)
        j = next(k for k in range(i + 1, len(lines)) if lines[k].strip() == "```")
        body = textwrap.dedent("\n".join(lines[i + 1:j])) + "\n"
        before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        mark = NOT_RUN.match(before)
        out.append(Block(rel, i + 1, lang, body, mark.group(1) if mark else None, generated))
        i = j + 1
    return out


def _doc_paths():
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


ALL_BLOCKS = [b for p in _doc_paths() for b in doc_blocks(p)]


def test_every_block_runs_or_says_why_not():
    unaccounted = [str(b) for b in ALL_BLOCKS if not b.runs
                   and not b.not_run and not b.generated]
    assert not unaccounted, ("blocks neither run by this test nor marked "
                             f"`<!-- not run: why -->`: {unaccounted}")
    assert sum(b.runs for b in ALL_BLOCKS) >= 20


def test_api_blocks_are_signatures_of_the_public_surface():
    import shardplan

    for b in (b for b in ALL_BLOCKS if b.path == "docs/api.md"):
        name = re.match(r"([\w.]+)\(", b.text)
        assert name, f"{b}: a block in api.md that is not a signature"
        parts = name.group(1).removeprefix("shardplan.").split(".")
        assert hasattr(shardplan, parts[0]), f"{b}: {parts[0]} is not public"


PRELUDE = '''
import jax, jax.numpy as jnp, numpy as np, optax, shardplan
from jax.sharding import AxisType, PartitionSpec as P

mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
opt = optax.adam(1e-3)


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["params"]["Dense_0"]["kernel"]
                 + params["params"]["Dense_0"]["bias"])
    out = h @ params["params"]["Dense_1"]["kernel"] + params["params"]["Dense_1"]["bias"]
    return jnp.mean((out - batch["y"]) ** 2)


def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


_r = np.random.default_rng(0)
params = {"params": {
    "Dense_0": {"kernel": jnp.asarray(_r.standard_normal((64, 128), np.float32) / 8),
                "bias": jnp.zeros(128)},
    "Dense_1": {"kernel": jnp.asarray(_r.standard_normal((128, 64), np.float32) / 11),
                "bias": jnp.zeros(64)}}}
opt_state = opt.init(params)
batch = {"x": jnp.asarray(_r.standard_normal((32, 64), np.float32)),
         "y": jnp.asarray(_r.standard_normal((32, 64), np.float32))}
'''

# What a page's fragments take as given, run before its first block (README's example is whole).
SETUP = {
    "README.md": "",
    "docs/troubleshooting.md": PRELUDE + '''
step = shardplan.auto(train_step, mesh=mesh, memory_budget="8KiB")   # fits no plan
''',
}

# Run before the block that starts with the key, on the page's namespace.
BEFORE = {
    # multihost.md, "Build the inputs": the user's init and data loader
    "params, opt_state = init(": '''
def init(key):
    return params, opt.init(params)
loader = iter([batch, batch])
''',
    # multihost.md, "Pipelines": a loss whose layers are one scan over stacked parameters
    "devices = sorted(jax.devices()": '''
def scan_loss(params, batch):
    def layer(h, w):
        return jnp.tanh(h @ w["w"] + w["b"]), None
    h, _ = jax.lax.scan(layer, batch["x"], params["layers"])
    return jnp.mean((h - batch["y"]) ** 2)

def train_step(params, opt_state, batch):
    loss, grads = shardplan.value_and_grad(scan_loss)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

_k = jax.random.split(jax.random.key(0), 3)
params = {"layers": {"w": jax.random.normal(_k[0], (8, 32, 32)) / 6, "b": jnp.zeros((8, 32))}}
opt_state = opt.init(params)
local_batch = {"x": jax.random.normal(_k[1], (16, 32)), "y": jax.random.normal(_k[2], (16, 32))}
''',
    # multihost.md, "MPMD pipelines": the step around the block's loss_fn, blocks of unequal widths
    "def loss_fn(params, x, y):": '''
def train_step(params, x, y):
    loss, grads = shardplan.value_and_grad(loss_fn)(params, x, y)
    return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss

_k = jax.random.split(jax.random.key(0), 6)
_widths = (32, 64, 48, 64, 32)
params = [{"kernel": jax.random.normal(_k[i], (a, b)) / 8, "bias": jnp.zeros(b)}
          for i, (a, b) in enumerate(zip(_widths, _widths[1:]))]
local_x = jax.random.normal(_k[4], (16, 32))
local_y = jax.random.normal(_k[5], (16, 32))
mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
''',
}

# What a block prints, where the page says so: (start of the block, text its output holds).
PRINTS = {
    "try:\n    step.plan(": "needs ",  # troubleshooting: InfeasibleMemory's figures
    "import warnings": "shardplan: no sharding rule for pure_callback; these ops run replicated",
    "devices = sorted(jax.devices()": "1F1B SPMD",  # multihost: the schedule the comment names
}

# Appended to `shardplan search` / `bench` commands: plan without compiling the comparison,
# and at a size planned in seconds.
SMALL = {
    "configs/demo.yaml": ["model.size=tiny", "model.overrides={num_layers: 2}"],
}
NO_COMPARE = ["output.compare=false", "search.measure=false"]

RUN_PATHS = sorted({b.path for b in ALL_BLOCKS if b.runs})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Page:
    """The blocks of one page run in order, in one namespace and one directory."""

    def __init__(self, path: str, cwd: pathlib.Path, capsys):
        self.path, self.cwd, self.capsys = path, cwd, capsys
        self.ns: dict = {"__name__": "__doc__"}
        self.written: dict[str, str] = {}
        (cwd / "configs").symlink_to(ROOT / "configs")

    def exec(self, code: str, where: str):
        exec(compile(code, where, "exec"), self.ns)  # noqa: S102 - the docs' own code

    def run(self, b: Block):
        if b.file_name and b.lang == "python":
            return self.write(b)
        if b.lang == "python":
            for start, code in BEFORE.items():
                if b.text.startswith(start):
                    self.exec(code, f"{b} (setup)")
            self.capsys.readouterr()
            self.exec(b.text, str(b))
            printed = self.capsys.readouterr().out
            for start, text in PRINTS.items():
                if b.text.startswith(start):
                    assert text in printed, f"{b} printed {printed!r}, not {text!r}"
            return None
        if b.lang == "yaml":
            return self.load_yaml(b)
        return self.shell(b)

    def write(self, b: Block):
        (self.cwd / b.file_name).write_text(b.text)
        self.written[b.file_name] = b.text

    def load_yaml(self, b: Block):
        import yaml

        from shardplan.config import load_config
        from shardplan.cost.hardware import get_profile

        name = b.file_name or f"block-{b.line}.yaml"
        (self.cwd / name).write_text(b.text)
        data = yaml.safe_load(b.text)
        if "model" in data and "cluster" in data:
            load_config(str(self.cwd / name))
        else:
            get_profile(str(self.cwd / name))

    def shell(self, b: Block):
        from shardplan import cli

        lines = b.text.splitlines()
        for k, line in enumerate(lines):
            cmd = line.strip().removeprefix("$ ")
            if cmd.startswith("shardplan "):
                argv = shlex.split(cmd.split(" #", 1)[0])[1:]
                if argv[0] in ("search", "bench"):
                    config = next((a for a in argv[1:] if not a.startswith("-")), "")
                    sets = NO_COMPARE + SMALL.get(config, [])
                    argv += [x for s in sets for x in ("--set", s)] + ["-q"]
                code = cli.main(argv)
                assert code == 0, f"{b}: `{cmd}` exited with {code}"
            elif cmd.startswith("python ") and " & " in cmd:
                script = cmd.split()[1]
                self.processes(b, script, lines[k + 1:])
                return

    def processes(self, b: Block, script: str, expected: list[str]):
        """Two processes of `script` (a jax.distributed job over 127.0.0.1), as the page runs it;
        what process 0 prints is what the page shows, line for line."""
        text = self.written[script].replace("127.0.0.1:12355", f"127.0.0.1:{_free_port()}")
        (self.cwd / script).write_text(text)
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
        procs = [subprocess.Popen([sys.executable, script, str(i)], cwd=self.cwd, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (_, err) in zip(procs, outs):
            assert p.returncode == 0, f"{b}: {script} failed:\n{err[-3000:]}"
        want = [ln for ln in expected if ln.strip()]
        # gloo logs its connections to the same stdout, interleaved: only the page's lines count
        got = [ln for ln in outs[0][0].splitlines() if ln in want]
        assert got == want, f"{b}: {script} printed {outs[0][0]!r}"


@pytest.mark.parametrize("path", RUN_PATHS)
def test_the_blocks_of_a_page_run(path, tmp_path, monkeypatch, devices, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    page = _Page(path, tmp_path, capsys)
    page.exec(SETUP.get(path, PRELUDE), f"{path} (setup)")
    blocks = [b for b in ALL_BLOCKS if b.path == path and b.runs]
    for b in blocks:  # files first: a command may name a file a later block shows
        if b.file_name:
            page.write(b) if b.lang == "python" else page.load_yaml(b)
    for b in blocks:
        if not (b.file_name and b.lang == "python"):
            page.run(b)


INTERNAL = re.compile(r"\bissue #?\d+|\bsessions?\b|\bthe lead\b|\bbeing (?:added|fixed)\b|"
                      r"\bonce .{0,40}\blands\b", re.IGNORECASE)


def test_the_docs_name_no_internal_work_items():
    """Users read what the code does, not the team's work items (issue numbers, sessions, what
    is being added): the README, docs/, every notebook cell and the shipped configs."""
    texts = [(p, t) for p, t in _markdown_sources()]
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        texts.append((path, "\n".join("".join(c["source"]) for c in cells)))
    texts += [(p, p.read_text()) for p in sorted((ROOT / "configs").rglob("*.yaml"))]
    found = [(str(p.relative_to(ROOT)), m.group()) for p, t in texts for m in INTERNAL.finditer(t)]
    assert not found, found
