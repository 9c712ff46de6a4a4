"""The torch releases phalanx supports, and the private torch names it still relies on.

The range runs from :data:`FLOOR` (the first release whose libuv TCPStore takes a listening
socket) to the newest release CI tests. Every private name phalanx uses is in
:data:`PRIVATE_NAMES` with the feature that needs it: one test (the canary) checks them all on
every release CI tests, and the env report names the features unsure outside the range.
Importing this module does not import torch.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
from dataclasses import dataclass

#: The oldest torch phalanx supports (pyproject.toml's ``torch>=`` says the same; a test checks).
FLOOR = (2, 8)
#: The release the whole suite runs on (the Makefile's TORCH_SPEC).
MAIN = "2.13.0"
#: The releases the compatibility suite runs on besides MAIN (the Makefile's TORCH_COMPAT).
COMPAT = ("2.8.0", "2.10.0", "2.14.1")


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string ("2.10.0+cu128" -> (2, 10)); None if it has none."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _text(parts: tuple[int, int]) -> str:
    return f"{parts[0]}.{parts[1]}"


#: The newest release tested, as (major, minor).
NEWEST = max(release(version) or FLOOR for version in (MAIN, *COMPAT))


def tested_range() -> str:
    """The tested releases as a person reads them: "2.8 to 2.14"."""
    return f"{_text(FLOOR)} to {_text(NEWEST)}"


def install_hint() -> str:
    """The pip line that installs a release inside the range."""
    return f"pip install 'torch>={_text(FLOOR)},<{NEWEST[0]}.{NEWEST[1] + 1}'"


def installed_torch() -> str | None:
    """The installed torch's version, read from its package metadata (torch is not imported)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def outside_range(version: str) -> str | None:
    """Why ``version`` is outside the tested range ("older than ..." / "newer than ..."); None inside."""
    found = release(version)
    if found is None:
        return f"not a release phalanx can read (tested: {tested_range()})"
    if found < FLOOR:
        return f"older than the releases phalanx supports ({tested_range()})"
    if found > NEWEST:
        return f"newer than the releases phalanx is tested with ({tested_range()})"
    return None


def check_installed() -> str:
    """The installed torch's version; refused (exit code 2) where torch is missing or older than
    the floor: phalanx would fail later, deep in a launch, with an AttributeError or a hang."""
    from phalanx.errors import SettingsRefused

    version = installed_torch()
    if version is None:
        raise SettingsRefused("torch is not installed in this Python environment", "phalanx runs on it.",
                              install_hint())  # fmt: skip
    found = release(version)
    if found is not None and found < FLOOR:
        raise SettingsRefused(
            f"torch {version} is older than the releases phalanx supports ({tested_range()})",
            f"phalanx needs what torch {_text(FLOOR)} added (its libuv TCPStore on a socket of phalanx's choosing, "
            "the flight recorder of gloo collectives).",
            f"install a supported release in this environment: {install_hint()}",
        )
    return version


@dataclass(frozen=True)
class PrivateName:
    """A private torch name phalanx uses: where it lives, what needs it, and how to find it."""

    module: str
    #: A dotted path inside the module, or, with ``assigned``, an attribute its class sets on self.
    path: str
    #: What phalanx loses where the name is gone, as the env report says it.
    feature: str
    #: The class (a dotted path inside ``module``) whose source assigns ``self.<path>``.
    assigned_by: str | None = None
    #: Present in CUDA builds only (NCCL's flight recorder).
    cuda_only: bool = False

    @property
    def where(self) -> str:
        owner = f"{self.assigned_by}()." if self.assigned_by else ""
        return f"{self.module}.{owner}{self.path}"


_AGENT = "torch.distributed.elastic.agent.server.api"
_RESTARTS = "restarts only where they can help, and no exit-barrier wait for a failed node"
_RECORDER = "the stall watchdog, and the count of each rank's collectives (the check that ranks communicated)"

#: Every private torch name phalanx uses, with the feature that needs it; the canary checks them.
PRIVATE_NAMES = (
    PrivateName("torch.distributed.launcher.api", "LocalElasticAgent", _RESTARTS),  # swapped for phalanx's subclass
    PrivateName(_AGENT, "SimpleElasticAgent._rendezvous", "each rendezvous round's store (the rank table, failures)"),
    PrivateName(_AGENT, "SimpleElasticAgent._monitor_workers", _RESTARTS),
    PrivateName(_AGENT, "SimpleElasticAgent._exit_barrier", _RESTARTS),
    PrivateName(_AGENT, "_remaining_restarts", _RESTARTS, assigned_by="SimpleElasticAgent"),
    PrivateName(_AGENT, "_exit_barrier_timeout", _RESTARTS, assigned_by="SimpleElasticAgent"),
    PrivateName(_AGENT, "_worker_group", _RESTARTS, assigned_by="SimpleElasticAgent"),
    PrivateName(
        "torch.distributed.elastic.multiprocessing.api",
        "_terminate_process_handler",
        "a second Ctrl-C that ends the workers at once",
    ),
    PrivateName(
        "torch.distributed.elastic.multiprocessing.api",
        "_local_ranks_filter",
        "--local-ranks-filter with phalanx's per-rank logs",
        assigned_by="DefaultLogsSpecs",
    ),
    PrivateName("torch._C._distributed_c10d", "_dump_fr_trace", _RECORDER),
    PrivateName("torch._C._distributed_c10d", "_dump_nccl_trace", _RECORDER + " on NCCL", cuda_only=True),
    PrivateName("torch.distributed.distributed_c10d", "_world.pg_names", "the stall report's members of a subgroup"),
    PrivateName("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", "reading checkpoints"),
    PrivateName("torch.distributed.checkpoint.filesystem", "_StorageInfo", "reading checkpoints"),
    PrivateName("torch.serialization", "_get_layout", "reading checkpoints"),
    PrivateName(
        "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook",
        "_should_compress",
        "PowerSGD's state in checkpoints (which of a bucket's matrices it compresses)",
    ),
    PrivateName(
        "torch.nn.parallel.distributed",
        "DistributedDataParallel._update_process_group",
        "healing: the survivors of a failure keep their processes",
    ),
)


def missing(name: PrivateName) -> str | None:
    """Why ``name`` cannot be found in the installed torch; None where it is there."""
    try:
        found: object = importlib.import_module(name.module)
        if name.assigned_by is not None:
            for part in name.assigned_by.split("."):
                found = getattr(found, part)
            source = inspect.getsource(found)  # type: ignore[arg-type]
            return None if re.search(rf"self\.{re.escape(name.path)}\s*[:=]", source) else "no longer assigned"
        for part in name.path.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as error:
        return f"{type(error).__name__}: {error}"
    except (OSError, TypeError) as error:  # no source to read (a build without .py files)
        return f"its source cannot be read ({error})"
    return None


def missing_names() -> list[tuple[PrivateName, str]]:
    """The private names the installed torch lacks, with why (imports torch)."""
    import torch

    cuda = torch.version.cuda is not None
    return [(name, why) for name in PRIVATE_NAMES if (cuda or not name.cuda_only) and (why := missing(name))]


def unsure_features() -> list[str]:
    """The features that rest on private names, in the order listed: unsure outside the range."""
    return list(dict.fromkeys(name.feature for name in PRIVATE_NAMES))


def update_ddp_group(ddp: object, group: object) -> None:
    """Points a DDP model at another process group (after its old one was destroyed): DDP's
    ``_update_process_group``, in PRIVATE_NAMES."""
    ddp._update_process_group(group)  # type: ignore[attr-defined]
