"""phalanx's packages form layers: each imports only its own layer and those below it.

The order, from the bottom: what everything uses (errors, exit codes, the console, the worker's
variables, the torch range, the launch settings, the test bed); the cluster environments'
readers; the runtime inside each rank; the launcher; the job writers (SLURM, Kubernetes, ssh); the
benchmarks; the diagnostics; the command line. Imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import phalanx

LAYERS = (
    {"exit_codes", "errors", "console", "quick_exit", "worker_env", "torch_compat", "settings", "testbed"},
    {"clusters"},
    {"runtime"},
    {"launch"},
    {"jobs"},
    {"bench"},
    {"diagnostics"},
    {"cli", "__main__"},
)
ROOT = Path(phalanx.__file__).parent


def layer_of(package: str) -> int:
    return next(index for index, names in enumerate(LAYERS) if package in names)


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom):  # "from phalanx import launch" imports phalanx.launch
            names += (
                [f"phalanx.{alias.name}" for alias in node.names] if node.module == "phalanx" else [node.module or ""]
            )
        found |= {name.split(".")[1] for name in names if name.startswith("phalanx.")}
    # a name of the package itself ("from phalanx import __version__") is no package
    return {name for name in found if (ROOT / name).is_dir() or (ROOT / f"{name}.py").is_file()}


def test_no_package_imports_a_package_above_it():
    above = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if parts == ("__init__.py",):
            continue  # the public API re-exports the runtime
        package = parts[0].removesuffix(".py")
        for imported in imported_packages(path) - {package}:
            if layer_of(imported) > layer_of(package):
                above.append(f"{path.relative_to(ROOT)} imports phalanx.{imported}")
    assert not above, "\n".join(above)


def test_the_settings_package_imports_only_the_errors():
    for path in (ROOT / "settings").glob("*.py"):
        assert imported_packages(path) <= {"settings", "errors"}, path


def test_every_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in ROOT.glob("*.py")} - {"__init__"}
    for name in packages | modules:
        layer_of(name)  # StopIteration: a new package needs its place in LAYERS
