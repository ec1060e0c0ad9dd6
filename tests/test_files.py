"""What is read from disk is not trusted (shardplan.files, shardplan.plan.load_plan): only
regular files, bounded in size and depth, strict JSON, YAML with aliases bounded; each probe of
issue 33 on plan files, configs and profiles gives the error the user should see, fast."""

import json
import os
import time

import jax
import jax.numpy as jnp
import pytest

import shardplan
from shardplan import files
from shardplan.config import ConfigError, load_config
from shardplan.cost.hardware import get_profile

# -- the reader ---------------------------------------------------------------------------


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    start = time.perf_counter()
    with pytest.raises(files.FileError, match="not a regular file .a FIFO"):
        files.read_text(fifo, what="plan file")
    assert time.perf_counter() - start < 1


def test_a_symlink_to_a_device_is_refused_and_one_to_a_file_followed(tmp_path):
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    with pytest.raises(files.FileError, match="a character device"):
        files.read_text(tmp_path / "zero.json")
    (tmp_path / "real.json").write_text("[1]")
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    assert files.load_json(tmp_path / "link.json") == [1]


def test_directories_large_files_and_non_utf8_are_refused(tmp_path):
    with pytest.raises(files.FileError, match="a directory"):
        files.read_text(tmp_path)
    big = tmp_path / "big.json"
    big.write_text("[" + "0," * 600 + "0]")
    with pytest.raises(files.FileError, match="more than the 1000 bytes read"):
        files.read_text(big, max_bytes=1000)
    (tmp_path / "latin1.json").write_bytes(b'["\xe9"]')
    with pytest.raises(files.FileError, match="not UTF-8"):
        files.load_json(tmp_path / "latin1.json")
    with pytest.raises(FileNotFoundError):
        files.read_text(tmp_path / "missing.json")


@pytest.mark.parametrize("text, match", [
    ('{"a": 1, "a": 2}', "has the key 'a' twice"),
    ("[NaN]", "holds NaN"),
    ('{"x": -Infinity}', "holds -Infinity"),
    ("[1e999]", "out of range"),
    ("[" + "9" * 40 + "]", "of 40 digits"),
    ("[\u0661]", "not valid JSON"),  # an Arabic-Indic digit is no JSON number
    ('{"a": [1, 2', "not valid JSON.*truncated"),
])
def test_json_is_parsed_strictly(text, match):
    with pytest.raises(files.FileError, match=match):
        files.parse_json(text, "f.json")


def test_deep_nesting_fails_before_the_parser_recurses():
    start = time.perf_counter()
    for text in ("[" * 100_000, '{"a":' * 100_000, "[" * 65 + "]" * 65):
        with pytest.raises(files.FileError, match="more than 64 deep"):
            files.parse_json(text)
    assert files.parse_json('["[[[[" , {"a": [[]]}]') == ["[[[[", {"a": [[]]}]
    assert time.perf_counter() - start < 1


def test_integers_are_ascii_digits():
    assert files.ascii_int("12") == 12 and files.ascii_int("-3") == -3
    for text in ("\u0661\u0662", " 3", "3_000", "+3", "", "1" * 30):
        assert files.ascii_int(text) is None


def _alias_bomb() -> str:
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [{','.join([f'*{prev}'] * 9)}]")
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_fails_at_once(tmp_path):
    bomb = _alias_bomb()
    assert len(bomb) < 600  # 9**9 strings once expanded
    start = time.perf_counter()
    with pytest.raises(files.FileError, match="once its YAML aliases are expanded"):
        files.parse_yaml(bomb, "config")
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb)
    with pytest.raises(ConfigError, match="alias bomb"):
        load_config(path)
    assert time.perf_counter() - start < 1


def test_yaml_aliases_are_bounded_and_not_recursive():
    ok = "a: &x {b: 1}\nc: *x\n"
    assert files.parse_yaml(ok, "config") == {"a": {"b": 1}, "c": {"b": 1}}
    many = "a: &x 1\nb: [" + ", ".join(["*x"] * 101) + "]\n"
    with pytest.raises(files.FileError, match="more than 100 YAML aliases"):
        files.parse_yaml(many, "config")
    with pytest.raises(files.FileError, match="recursive alias"):
        files.parse_yaml("a: &r [*r]\n", "config")
    with pytest.raises(files.FileError, match="not valid YAML"):
        files.parse_yaml("a: [1, 2\n", "config")


def test_a_profile_with_a_yaml_syntax_error_is_a_value_error_naming_the_file(tmp_path):
    path = tmp_path / "hw.yaml"
    path.write_text("name: x\npeak_flops: [1\n")
    with pytest.raises(ValueError, match=f"{path}: the hardware profile is not valid YAML"):
        get_profile(str(path))
    path.write_text(_alias_bomb())
    with pytest.raises(ValueError, match="alias"):
        get_profile(str(path))


def test_printable_shows_control_characters_as_escapes():
    assert files.printable("plain [text]\nnext") == "plain [text]\nnext"
    shown = files.printable("a\x1b[2Jb\x07c\x9bd\u202ee")
    assert shown == "a\\x1b[2Jb\\x07c\\x9bd\\u202ee"
    assert all(c.isprintable() for c in shown)


# -- plan files -----------------------------------------------------------------------------


def small_step(w, x):
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    return w - 0.1 * g, loss


ARGS = (jax.ShapeDtypeStruct((16, 16), jnp.float32), jax.ShapeDtypeStruct((32, 16), jnp.float32))


@pytest.fixture(scope="module")
def plan_dict(tmp_path_factory):
    plan = shardplan.search(small_step, *ARGS, cluster="cpu", mesh_shape=(8,), axis_names=("x",))
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return json.loads(path.read_text())


def _write(tmp_path, d, edit=None) -> str:
    d = json.loads(json.dumps(d))
    text = edit(d) if edit is not None else None
    path = tmp_path / "plan.json"
    path.write_text(text if isinstance(text, str) else json.dumps(d))
    return path


def _stage(d):
    return {"layers": [], "submesh_shape": [8], "devices": list(range(8)),
            "estimate": d["estimate"]}


PROBES = [
    # (what the issue saw, the edit, the error the user should see)
    ("NaN estimate", lambda d: json.dumps(d).replace('"compute_s": ', '"compute_s": NaN, "x": ', 1),
     "holds NaN"),
    ("inf estimate", lambda d: d["estimate"].update(peak_bytes=float("inf")), "holds Infinity"),
    ("1e999 budget", lambda d: json.dumps({**d, "memory_budget": 1}).replace(
        '"memory_budget": 1', '"memory_budget": 1e999'), "out of range"),
    ("negative budget", lambda d: d.update(memory_budget=-5), "positive, finite number"),
    ("null fingerprint", lambda d: d.update(fingerprint=None), "has no fingerprint"),
    ("missing fingerprint", lambda d: d.pop("fingerprint"), "has no fingerprint"),
    ("version true", lambda d: d.update(version=True), "version true is not one"),
    ("version 1.0", lambda d: d.update(version=1.0), "version 1.0 is not one"),
    ("duplicate keys", lambda d: json.dumps(d).replace('{"', '{"hardware": "x", "', 1),
     "key 'hardware' twice"),
    ("junk field", lambda d: d.update(junk=1), "plan has the unknown field 'junk'; its fields"),
    ("junk in estimate", lambda d: d["estimate"].update(junk=1),
     "estimate has the unknown field 'junk'"),
    ("junk in a spec", lambda d: d["inputs"][0]["spec"].update(junk=1),
     r"inputs\[0\].spec has the unknown field"),
    ("junk in the fingerprint", lambda d: d["fingerprint"].update(junk="x"),
     "fingerprint has the unknown field"),
    ("non-ASCII digits", lambda d: d["constraints"].update({"\u0661\u0662": d["inputs"][0]["spec"]}),
     "integers in ASCII digits"),
    ("deep nesting", lambda d: json.dumps(d)[:-1] + ', "notes": ' + "[" * 100_000 + "]" * 100_000
     + "}", "more than 64 deep"),
    ("stage with no layers", lambda d: d.update(stages=[_stage(d)]),
     r"stages\[0\].layers should be \[first layer, last layer\]"),
    ("repeated axis", lambda d: d["inputs"][0]["spec"].update(dims=[["x"], ["x"]]),
     "uses the mesh axis 'x' more than once"),
    ("huge integer size", lambda d: d["mesh"].update(sizes=[2**63]), "finite number below"),
    ("schedule", lambda d: d.update(schedule="\x1b[2J"), r"schedule should be one of"),
]


@pytest.mark.parametrize("what, edit, match", PROBES, ids=[p[0] for p in PROBES])
def test_each_probe_of_a_plan_file_is_a_plan_file_error(tmp_path, plan_dict, what, edit, match):
    path = _write(tmp_path, plan_dict, edit)
    start = time.perf_counter()
    with pytest.raises(shardplan.PlanFileError, match=match) as e:
        shardplan.load_plan(path)
    assert e.value.path == path and str(path) in str(e.value)
    assert time.perf_counter() - start < 1
    assert "\x1b" not in str(e.value)


def test_a_fifo_or_dev_zero_plan_is_a_plan_file_error(tmp_path):
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    for name in ("fifo.json", "zero.json"):
        with pytest.raises(shardplan.PlanFileError, match="not a regular file"):
            shardplan.load_plan(tmp_path / name)


def test_a_valid_file_loads_and_versions_are_exact(tmp_path, plan_dict):
    assert shardplan.load_plan(_write(tmp_path, plan_dict)).fingerprint is not None
    assert isinstance(plan_dict["version"], int)


def test_the_summary_shows_file_text_inert(tmp_path, plan_dict):
    def edit(d):
        d["notes"] = ["[/] closes nothing", "\x1b[2J\x1b]52;c;aGk=\x07 clipboard"]
        d["hardware"] = "cpu\x1b]8;;http://x\x07link"
        d["ops"] = [{"primitive": "[bold]dot", "name": "[/]", "strategy": "\x1b[31m",
                     "compute_s": 0.0, "comm_s": 0.0}]
    text = shardplan.load_plan(_write(tmp_path, plan_dict, edit)).summary()
    assert "\x1b" not in text and "\x07" not in text
    assert "[/] closes nothing" in text and "\\x1b[2J" in text and "[bold]dot" in text
