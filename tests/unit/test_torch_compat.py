"""The supported torch range: one fact in one place, refused below its floor, said above it; and
the canary: every private torch name phalanx uses is still there (make test-compat runs the
tests marked compat on every release CI tests)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx import torch_compat
from phalanx.diagnostics import torch_facts, traps
from tests.conftest import REPO, run_command

PROBE = """
import pickle, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
for _ in range(3):
    dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(includeCollectives=False, includeStackTraces=False))
print(repr((dump["pg_config"], dump["pg_status"])))
"""


@pytest.mark.compat
def test_every_private_torch_name_phalanx_uses_is_there():
    import torch

    gone = torch_compat.missing_names()
    assert not gone, (
        f"torch {torch.__version__} lacks private names phalanx uses (src/phalanx/torch_compat.py): "
        + "; ".join(f"{name.where}: {why} -> {name.feature}" for name, why in gone)
    )


@pytest.mark.compat
@pytest.mark.parametrize("size", ["0", "20"])
def test_the_flight_recorder_dump_reads_as_phalanx_reads_it(size):
    """What the collective count rests on (watchdog.collectives_issued): a recorder that is off
    registers no group; one that is on keeps each group's count after it is destroyed."""
    probe = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, "TORCH_FR_BUFFER_SIZE": size},
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    config, status = eval(probe.stdout.splitlines()[-1])
    if size == "0":
        assert config == {} and status == {}
    else:
        assert config and [group["last_enqueued_collective"] for group in status.values()] == [3]


def _private_torch_names(path: Path) -> set[str]:
    """The private torch names a source file reads through a module: ``torch._C``, ``hook._name``
    where ``hook`` is a torch module imported under that name, ``from torch.x import _name``."""
    tree = ast.parse(path.read_text())
    modules: dict[str, str] = {}  # a local name -> the torch module it stands for
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    modules[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.add(f"{node.module}.{alias.name}")
                modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        chain = []
        while isinstance(node, ast.Attribute):
            chain.insert(0, node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in modules and chain:
            private = next(
                (i for i, part in enumerate(chain) if part.startswith("_") and not part.startswith("__")), None
            )
            if private is not None:
                found.add(".".join([modules[node.id], *chain[: private + 1]]))
    return found


def test_every_private_torch_name_in_src_is_in_the_canary_list():
    """A private name read outside torch_compat.PRIVATE_NAMES would break on another torch without
    the canary saying so."""
    listed = [name.where.replace("()", "") for name in torch_compat.PRIVATE_NAMES]
    unlisted = []
    for path in sorted((REPO / "src" / "phalanx").rglob("*.py")):
        for name in sorted(_private_torch_names(path)):
            if not any(where == name or where.startswith(f"{name}.") for where in listed):
                unlisted.append(f"{path.relative_to(REPO)}: {name}")
    assert not unlisted, "private torch names missing from torch_compat.PRIVATE_NAMES:\n" + "\n".join(unlisted)


def test_the_range_is_written_once():
    floor = ".".join(map(str, torch_compat.FLOOR))
    assert f'"torch>={floor}"' in (REPO / "pyproject.toml").read_text()
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^TORCH_SPEC \?= torch==(\S+)$", makefile, re.M).group(1) == torch_compat.MAIN
    assert tuple(re.search(r"^TORCH_COMPAT \?= (.+)$", makefile, re.M).group(1).split()) == torch_compat.COMPAT
    assert torch_compat.COMPAT[0].startswith(floor + ".")
    assert f"Supported torch: {torch_compat.tested_range()}" in (REPO / "README.md").read_text()


@pytest.mark.parametrize(
    "version, verdict",
    [("2.13.0+cpu", None), ("2.8.0", None), ("2.9.1", None), ("2.14.1+cu128", None),
     ("2.7.1", "older than the releases phalanx supports (2.8 to 2.14)"),
     ("2.15.0", "newer than the releases phalanx is tested with (2.8 to 2.14)"),
     ("3.0.0a0", "newer than the releases phalanx is tested with (2.8 to 2.14)"),
     ("nightly", "not a release phalanx can read (tested: 2.8 to 2.14)")],
)  # fmt: skip
def test_a_version_inside_or_outside_the_range(version, verdict):
    assert torch_compat.outside_range(version) == verdict


def test_phalanx_run_refuses_a_torch_below_the_floor_before_anything_starts(tmp_path):
    """A real `phalanx run` whose environment's torch reads as 2.7.1 (a dist-info of that version
    first on the path, as an older torch installed over phalanx's requirement would be)."""
    fake = tmp_path / "site" / "torch-2.7.1.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.7.1\n")
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never started')\n")
    result = run_command([sys.executable, "-m", "phalanx", "run", "--simulate-nodes", "2", str(script)], timeout=60,
                         cwd=tmp_path, env={"PYTHONPATH": f"{tmp_path / 'site'}:{REPO / 'src'}"})  # fmt: skip
    assert result.returncode == 2, result.output
    assert "torch 2.7.1 is older than the releases phalanx supports (2.8 to 2.14)" in result.stderr
    assert "HINT: install a supported release in this environment: pip install 'torch>=2.8,<2.15'" in result.stderr
    assert "never started" not in result.output and not (tmp_path / "phalanx-logs").exists()


def test_the_decision_block_names_the_torch_release(tmp_path):
    import torch

    (tmp_path / "x.py").write_text("")
    result = run_command([sys.executable, "-m", "phalanx", "run", "--dry-run", "--simulate-nodes", "2", "x.py"],
                         timeout=60, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.output
    assert result.stdout.startswith(f"phalanx 0.1.0 on torch {torch.__version__}: this host runs job"), result.stdout
    assert "warning    torch" not in result.stdout


def facts(version: str, missing: tuple[str, ...] = ()) -> torch_facts.TorchFacts:
    return torch_facts.TorchFacts(version, None, None, False, None, None, True, True, False, False, missing)


def test_env_and_doctor_name_what_is_unsure_outside_the_range():
    assert traps.torch_range_traps(facts("2.13.0+cpu")) == []
    (newer,) = traps.torch_range_traps(facts("2.15.0"))
    assert (
        newer.topic == "torch-untested"
        and newer.what == "torch 2.15.0 is newer than the releases phalanx is tested with (2.8 to 2.14)"
    )
    assert "the stall watchdog" in newer.why and "a second Ctrl-C" in newer.why and "reading checkpoints" in newer.why
    assert newer.hint.startswith("pip install 'torch>=2.8,<2.15'")
    gone = "torch._C._distributed_c10d._dump_fr_trace (the stall watchdog)"
    (lacking,) = traps.torch_range_traps(facts("2.13.0", (gone,)))
    assert lacking.topic == "torch-private-missing" and gone in lacking.what


def test_env_says_the_tested_range():
    import torch

    result = run_command([sys.executable, "-m", "phalanx", "env"], timeout=60, cwd=Path.cwd())
    assert result.returncode == 0, result.output
    assert f"version   {torch.__version__} (phalanx is tested with 2.8 to 2.14)" in result.stdout
