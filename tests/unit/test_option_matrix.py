"""The bad-input matrix generated from the option table: every launch option, every bad value of
its kind, every way of giving it, every command that starts a job.

Nothing here is written per option: each option's ``kind`` (phalanx.settings.options) picks its
bad values from :data:`BAD`, and a new option gets its cases from the table. Each case runs the
command in this process and must end with exit code 2, a message that names the value's origin
(the flag, the variable or the config file), a HINT, no traceback, no output and no process left.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections import Counter

import psutil
import pytest

from phalanx.cli.main import main
from phalanx.settings.options import LAUNCH_OPTIONS, VALUE_KINDS, Option

#: Bad values of each kind of value. "FILE" becomes a file's path, where a folder belongs.
BAD: dict[str, tuple[str, ...]] = {
    "nodes": ("0", "-1", "3:2", "1.5", "nan", "two", "2 nodes", ""),
    "processes": ("0", "-1", "1.5", "nan", "inf", "many", ""),
    "endpoint": ("host:99999", "host:-1", "host:x", "[::1", "a b:29400", ""),
    "name": ("a b", "x" * 70, "a'b", 'a"b', "a\nb", ""),
    "count": ("-1", "1.5", "nan", "inf", "x", "3 times", ""),
    "folder": ("FILE", "/proc/phalanx-logs"),
    "choice": ("mpi", "NCCL2", ""),
    "interface": ("nope0", "a b", ""),
    "seconds": ("-1", "0", "nan", "inf", "-inf", "1e11", "x", "10 s", ""),
    "switch": ("maybe", "2"),  # an empty variable is off, as unset
}
#: Values that are bad on this machine (a file here, this host's interfaces), and the commands
#: that check them here: the others start jobs on other machines, which have their own.
MACHINE_VALUES = {
    "FILE": {"run", "run-simulated", "slurm"},
    "/proc/phalanx-logs": {"run", "run-simulated", "slurm"},
    "nope0": {"run", "run-simulated"},
}
#: Each command that starts a job, and what it needs besides the option (train.py is the script).
#: Simulated nodes are set up on their own path, which must refuse alike.
COMMANDS = {
    "run": ["run", "--dry-run"],
    "run-simulated": ["run", "--dry-run", "--simulate-nodes", "2"],
    "launch": ["launch", "--hosts", "h1,h2", "--dry-run"],
    "slurm": ["slurm"],
    "k8s": ["k8s", "--kind", "indexed-job", "--image", "registry.example.com/train:1"],
}
WAYS = ("flag", "PHALANX_<FLAG>", "PET_<FLAG>", "config")


def ways_of(option: Option) -> list[str]:
    return [
        way
        for way in WAYS
        if not (way == "flag" and option.is_switch) and not (way == "PET_<FLAG>" and not option.torchrun_has_it)
    ]


def toml_value(value: str) -> str:
    """The value as a TOML file would hold it: numbers (nan and inf too) as numbers, the rest quoted."""
    try:
        float(value)
    except ValueError:
        return json.dumps(value)
    return value if value.strip() == value and value else json.dumps(value)


CASES = [
    (command, option, way, value)
    for option in LAUNCH_OPTIONS
    for value in BAD[option.kind]
    for way in ways_of(option)
    for command in COMMANDS
    if command in MACHINE_VALUES.get(value, COMMANDS)
    # the command's own flag would win over the value under test given any other way
    and (option.flag == "dry-run" or f"--{option.flag}" not in COMMANDS[command])
]


def given(command: str, option: Option, way: str, value: str, folder) -> tuple[list[str], dict[str, str], str]:
    """argv, this shell's variables, and the words that must name the value's origin."""
    value = str(folder / "train.py") if value == "FILE" else value
    # --dry-run keeps a wrongly accepted value from starting anything; a flag would hide the value
    # under test when that is --dry-run's own (a flag wins over the variables and the config).
    base = [arg for arg in COMMANDS[command] if option.flag != "dry-run" or arg != "--dry-run"]
    if way == "flag":
        return [*base, f"--{option.flag}={value}", "train.py"], {}, f"--{option.flag}"
    if way == "config":
        (folder / "bad.toml").write_text(f"[run]\n{option.field} = {toml_value(value)}\n")
        return [*base, "--config", "bad.toml", "train.py"], {}, "bad.toml"
    variable = option.env_var if way == "PHALANX_<FLAG>" else option.torchrun_var
    assert variable is not None
    if command == "k8s":  # the pods see the manifest's variables, not this shell's
        return [*base, "--env", f"{variable}={value}", "train.py"], {}, variable
    return [*base, "train.py"], {variable: value}, variable


def test_every_option_has_a_kind_with_bad_values():
    assert set(VALUE_KINDS) == set(BAD)
    for option in LAUNCH_OPTIONS:
        assert option.kind in BAD and (option.kind == "switch") == option.is_switch, option


def test_the_matrix_size_per_kind_and_command():
    by_kind = Counter(option.kind for _, option, _, _ in CASES)
    by_command = Counter(command for command, _, _, _ in CASES)
    print(f"MEASURED: {len(CASES)} cases; by kind {dict(by_kind)}; by command {dict(by_command)}")
    assert len(CASES) >= 2 * len(COMMANDS) * sum(len(BAD[o.kind]) for o in LAUNCH_OPTIONS)


@pytest.mark.parametrize(
    "command, option, way, value",
    CASES,
    ids=[f"{c}-{o.flag}-{w}-{v!r}" for c, o, w, v in CASES],
)
def test_a_bad_value_is_refused_naming_where_it_came_from(command, option, way, value, folder, monkeypatch):
    argv, shell, origin = given(command, option, way, value, folder)
    for name, text in shell.items():
        monkeypatch.setenv(name, text)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's own refusals
            code = exit_.code
    said = err.getvalue()
    assert code == 2, said
    assert "phalanx: error:" in said and "\nHINT: " in said, said
    assert origin in said, said  # the value given is blamed where it was given
    assert "Traceback" not in said, said
    assert out.getvalue() == "", out.getvalue()
    assert psutil.Process().children(recursive=True) == []


#: Config files that cannot be read as one, by name in the test's folder: what to make there.
BAD_CONFIGS = {
    "missing.toml": None,
    "folder.toml": "DIR",
    "binary.toml": b"\x00\x01\x02\xff\xfe",
    "latin1.toml": "nproc_per_node = 2  # réglé à la main\n".encode("latin-1"),
    "not_toml.toml": "this is not toml\n",
    "unknown_key.toml": "nonsense = 1\n",
}
#: Every command that reads the config file, with what it needs besides.
CONFIG_COMMANDS = {
    **{name: [*argv, "train.py"] for name, argv in COMMANDS.items()},
    "env": ["env"],
    "doctor": ["doctor", "--dry-run"],
}
CONFIG_CASES = [
    (command, name, way)
    for command in CONFIG_COMMANDS
    for name in BAD_CONFIGS
    for way in ("--config", "PHALANX_CONFIG")
]


@pytest.mark.parametrize("command, name, way", CONFIG_CASES, ids=[f"{c}-{n}-{w}" for c, n, w in CONFIG_CASES])
def test_a_config_file_that_cannot_be_read_is_refused_by_every_command(command, name, way, folder, monkeypatch):
    content = BAD_CONFIGS[name]
    if content == "DIR":
        (folder / name).mkdir()
    elif isinstance(content, bytes):
        (folder / name).write_bytes(content)
    elif content is not None:
        (folder / name).write_text(content)
    argv = list(CONFIG_COMMANDS[command])
    if way == "--config":
        argv[1:1] = ["--config", name]
    else:
        monkeypatch.setenv("PHALANX_CONFIG", name)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    said = err.getvalue()
    assert code == 2, said
    assert (f"--config {name}" if way == "--config" else f"PHALANX_CONFIG={name}") in said, said
    assert "\nHINT: " in said, said
    assert "Traceback" not in said and out.getvalue() == "", said
    assert psutil.Process().children(recursive=True) == []
