"""Where launch settings come from: the option table, the config file and the one resolver.

Every setting has one entry in :data:`LAUNCH_OPTIONS`, which gives its flag (dashed, with
torchrun's underscore spelling as an alias), its ``PHALANX_<FLAG>`` variable, its key in a
``--config`` TOML file and, for the flags torchrun has too, torchrun's ``PET_<FLAG>`` variable
(which Kubernetes controllers set per pod). Precedence, highest first: flag > PET_<FLAG> >
PHALANX_<FLAG> > config file > the cluster environment (:mod:`phalanx.launch.cluster`) > default.
This package imports none of phalanx's others but errors: every command and cluster reader builds on it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from phalanx.errors import SettingsRefused
from phalanx.settings import values
from phalanx.settings.values import Resolved

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

ENV_PREFIX = "PHALANX_"
#: torchrun reads each of its flags from PET_<FLAG> when the flag is not given.
TORCHRUN_PREFIX = "PET_"


#: The classes of value a launch option takes (Option.kind).
VALUE_KINDS = ("nodes", "processes", "endpoint", "name", "count", "folder", "choice", "interface", "seconds", "switch")


@dataclass(frozen=True)
class Option:
    """One launch setting: its flag, how its text is parsed, and the LaunchSpec field it fills."""

    flag: str  # without the leading dashes, e.g. "nproc-per-node"
    parse: Callable[[object], Any]
    help: str
    metavar: str | None = None
    torchrun_has_it: bool = False  # torchrun has the same flag, and reads it from PET_<FLAG>
    #: The class of value it takes, one of VALUE_KINDS: the bad-input matrix tests each class's
    #: bad values for every option of it, in every command and every way of giving it.
    kind: str = "switch"

    @property
    def is_switch(self) -> bool:
        """A flag that takes no value."""
        return self.kind == "switch"

    @property
    def field(self) -> str:
        return self.flag.replace("-", "_")

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.field.upper()

    @property
    def torchrun_var(self) -> str | None:
        return TORCHRUN_PREFIX + self.field.upper() if self.torchrun_has_it else None


def _int_option(flag: str, minimum: int) -> Callable[[object], int]:
    return lambda value: values.parse_int(value, minimum=minimum, name=f"--{flag}")


LAUNCH_OPTIONS: tuple[Option, ...] = (
    Option(
        "nnodes",
        values.parse_nnodes,
        "number of nodes, N or MIN:MAX for an elastic job (default 1, or what the cluster environment says)",
        "N|MIN:MAX",
        torchrun_has_it=True,
        kind="nodes",
    ),
    Option(
        "nproc-per-node",
        values.parse_nproc_per_node,
        "worker processes per node: a number (usually the GPUs per node), auto (GPUs if any, else CPU cores), "
        "gpu or cpu (default 1, or the GPUs the cluster environment gives each node)",
        "N|auto|gpu|cpu",
        torchrun_has_it=True,
        kind="processes",
    ),
    Option(
        "rdzv-endpoint",
        values.parse_endpoint,
        "the main node's address, HOST[:PORT] (port 29400 if omitted), the same on every node; "
        "the node that owns this address hosts the rendezvous store (default: the cluster environment's first node)",
        "HOST[:PORT]",
        torchrun_has_it=True,
        kind="endpoint",
    ),
    Option(
        "rdzv-id",
        values.parse_rdzv_id,
        "job name, the same on every node (default phalanx, or the scheduler's job ID)",
        "ID",
        torchrun_has_it=True,
        kind="name",
    ),
    Option(
        "max-restarts",
        _int_option("max-restarts", 0),
        "restart all workers this many times after a failure (default 0); not after a refusal of the settings "
        "or a stop for preemption",
        "N",
        torchrun_has_it=True,
        kind="count",
    ),
    Option(
        "heal",
        _int_option("heal", 0),
        "replace a failed process up to N times per rank while the other ranks keep theirs: the new one gets the "
        "state from a peer and the failed step is trained again (default 0: off). Needs phalanx.Run with a "
        "checkpoint folder: where a heal cannot finish, the job goes back to its newest checkpoint",
        "N",
        kind="count",
    ),
    Option(
        "log-dir",
        lambda value: Path(str(value)),
        "folder for per-rank logs (default ./phalanx-logs)",
        "DIR",
        torchrun_has_it=True,
        kind="folder",
    ),
    Option(
        "backend",
        values.parse_backend,
        "auto (nccl with GPUs, gloo without), nccl or gloo (default auto)",
        "NAME",
        kind="choice",
    ),
    Option(
        "interface",
        values.parse_interface,
        "network interface to use (sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME); default: the one that routes to "
        "the endpoint",
        "IFNAME",
        kind="interface",
    ),
    Option(
        "join-timeout",
        lambda value: values.parse_seconds(value, name="--join-timeout"),
        "seconds to wait for all nodes to join (default 300)",
        "SECONDS",
        kind="seconds",
    ),
    Option(
        "last-call",
        lambda value: values.parse_seconds(value, name="--last-call", example=10),
        "elastic jobs (--nnodes MIN:MAX): seconds a rendezvous round waits for more nodes once MIN have joined, "
        "before it starts without them (default 30, as torchrun)",
        "SECONDS",
        kind="seconds",
    ),
    Option(
        "heartbeat-timeout",
        values.parse_heartbeat_timeout,
        "in a job of a fixed node count: seconds a node may go without a sign of life (its machine down, its "
        "network cut) before the other nodes count it lost and stop their workers; each node beats every sixth of "
        f"it (default {values.DEFAULT_HEARTBEAT_TIMEOUT_S:g}, the same on every node; an elastic job's lost node is "
        "left to torch's rendezvous)",
        "SECONDS",
        kind="seconds",
    ),
    Option(
        "simulate-nodes",
        values.parse_simulated_nodes,
        "run K node agents on this host: rehearse a multi-node launch on one machine",
        "K",
        kind="count",
    ),
    Option(
        "standalone",
        values.parse_flag,
        "single node with a private local rendezvous (as torchrun --standalone)",
        torchrun_has_it=True,
    ),
    Option(
        "headless-service",
        values.parse_service_name,
        "Kubernetes Indexed Job: the headless Service of the pod template's subdomain; pod 0 of the Job, "
        "<job>-0.<service>, is then the endpoint",
        "NAME",
        kind="name",
    ),
    Option(
        "allow-public-endpoint",
        values.parse_flag,
        "let the endpoint be a globally routable address: torch's rendezvous store has no authentication, so "
        "anyone who reaches its port could join or disturb the job",
    ),
    Option(
        "independent-ranks",
        values.parse_flag,
        "the ranks are meant to work alone (an evaluation sharded by RANK): no check that they communicated",
    ),
    Option("all-ranks", values.parse_flag, "show every rank's output on the console, not only rank 0's"),
    Option(
        "dry-run",
        values.parse_flag,
        "print the plan and the torchrun commands this would run here, start nothing",
    ),
)

_BY_FIELD = {option.field: option for option in LAUNCH_OPTIONS}


_ENDPOINT = (
    "the nodes meet at --rdzv-endpoint, and phalanx sets MASTER_ADDR and MASTER_PORT for the workers",
    "give the main node's address and port as --rdzv-endpoint HOST:PORT, the same on every node",
)
_CONSOLE = (
    "phalanx run writes every rank's output to its log folder and shows rank 0's on the console",
    "drop it; --all-ranks shows every rank's output",
)
#: torchrun's flags that phalanx does not take: flag -> (what phalanx does instead, what to type).
TORCHRUN_ONLY = {
    "no-python": ("phalanx run starts SCRIPT with this Python (or a module, with -m)",
                  "run a Python script or module; start another program from a small Python script"),
    "node-rank": ("the rendezvous ranks the nodes in the order they join (torchrun ignores --node-rank with c10d too); "
                  "under a scheduler the node's rank comes from its variables",
                  "drop --node-rank: the rank table printed at the start shows which node got which ranks"),
    "master-addr": _ENDPOINT,
    "master-port": _ENDPOINT,
    "rdzv-backend": ("phalanx always uses torchrun's c10d rendezvous", "drop --rdzv-backend"),
    "local-addr": ("each node advertises the address of its interface that routes to the endpoint",
                   "drop --local-addr; to advertise another interface's address, name it: --interface NAME"),
    "tee": _CONSOLE, "redirects": _CONSOLE, "local-ranks-filter": _CONSOLE,
    "rdzv-conf": ("the rendezvous's timeouts come from --join-timeout and --last-call",
                  "drop --rdzv-conf; give --join-timeout or --last-call"),
    "logs-specs": ("phalanx run lays the logs out by global rank itself", "drop --logs-specs"),
    **dict.fromkeys(("start-method", "monitor-interval", "role", "run-path", "virtual-local-rank", "numa-binding",
                     "signals-to-handle", "shutdown-timeout", "event-log-handler", "duplicate-stdout-filters",
                     "duplicate-stderr-filters"), ("phalanx run keeps torchrun's default for it", "drop it")),
}  # fmt: skip


class _TorchrunOnly(argparse.Action):
    """A torchrun flag pasted into a phalanx command: noted, to be refused with the others of the
    command line, each with what phalanx does instead (:func:`refuse_torchrun_flags`), not
    argparse's bare 'unrecognized arguments' one at a time."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        namespace.torchrun_flags = [*getattr(namespace, "torchrun_flags", []), (option_string, self.dest)]


def refuse_torchrun_flags(namespace: argparse.Namespace) -> None:
    """Refuses every torchrun flag of the command line at once, each with what to do instead."""
    given = getattr(namespace, "torchrun_flags", [])
    if not given:
        return
    flags = ", ".join(flag for flag, _ in given)
    whys = list(dict.fromkeys(f"{TORCHRUN_ONLY[dest][0]}." for _, dest in given))
    hints: dict[str, list[str]] = {}  # what to type -> the flags it is for
    for flag, dest in given:
        hints.setdefault(TORCHRUN_ONLY[dest][1], []).append(flag)
    hint = (
        "; ".join(f"{', '.join(flags)}: {hint}" for hint, flags in hints.items())
        if len(hints) > 1
        else next(iter(hints))
    )
    one = len(given) == 1
    raise SettingsRefused(f"{flags} {'is' if one else 'are'} torchrun's: phalanx does not take {'it' if one else 'them'}",
                          " ".join(whys), hint)  # fmt: skip


def add_launch_options(parser: argparse.ArgumentParser) -> None:
    """Adds the launch flags; defaults stay None so that unset flags fall through to env and config."""
    group = parser.add_argument_group("launch options (each also PHALANX_<FLAG> or a key in --config)")
    for option in LAUNCH_OPTIONS:
        spellings = [(f"--{option.flag}", option.help)]
        if "-" in option.flag:
            spellings.append((f"--{option.field}", argparse.SUPPRESS))  # torchrun's spelling, kept out of --help
        takes = {"action": "store_const", "const": True} if option.is_switch else {"metavar": option.metavar}
        for name, help_text in spellings:
            group.add_argument(name, dest=option.field, default=None, help=help_text, **takes)
    group.add_argument(
        "--config", dest="config", default=None, metavar="FILE", help="TOML file of launch settings; flags override it"
    )
    for flag in TORCHRUN_ONLY:
        spellings = {f"--{flag}", f"--{flag.replace('-', '_')}"}
        group.add_argument(*sorted(spellings), dest=flag, nargs="?", action=_TorchrunOnly, help=argparse.SUPPRESS)


def add_script_arguments(parser: argparse.ArgumentParser) -> None:
    """SCRIPT (or -m MODULE) and its arguments, passed on untouched, as torchrun takes them."""
    parser.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m")
    parser.add_argument("training_script", nargs="?", metavar="SCRIPT", help="the training script (or module with -m)")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to it untouched")


def given_flags(flags: Mapping[str, object], leave_out: Collection[str] = ()) -> list[str]:
    """The launch flags set in ``flags`` (field -> value; None or absent: not given), less the fields
    in ``leave_out``, as ``phalanx run`` takes them, in :data:`LAUNCH_OPTIONS`' order: for the
    command that another tool (a batch script, a remote host, a pod) runs on every node.

    Example:
        >>> given_flags({"nproc_per_node": "4", "all_ranks": True, "nnodes": "2"}, leave_out={"nnodes"})
        ['--nproc-per-node', '4', '--all-ranks']
    """
    argv: list[str] = []
    for option in LAUNCH_OPTIONS:
        value = flags.get(option.field)
        if value is None or option.field in leave_out:
            continue
        argv += [f"--{option.flag}"] if option.is_switch else [f"--{option.flag}", str(value)]
    return argv


def refuse_settings(settings: Mapping[str, Resolved], refused: Mapping[str, str], command: str, instead: str) -> None:
    """Refuses the first of ``refused`` (field -> why it does not apply) that ``settings`` sets, from
    a flag, a variable or the config file: for commands that start jobs elsewhere. The refusal
    names ``command`` and says ``instead`` after "drop it"."""
    for name, why in refused.items():
        if name in settings and settings[name].value:
            flag = name.replace("_", "-")
            raise SettingsRefused(f"--{flag} with {command} (from {settings[name].origin})", f"--{flag} {why}.",
                                  f"drop it (the flag, the variable, or the config's key); {instead}")  # fmt: skip


def read_config_file(path: Path, given: str | None = None) -> dict[str, object]:
    """A TOML file of launch settings, keys spelled as the flags (dashes or underscores). Refusals
    name it as ``given`` (default ``--config PATH``; ``PHALANX_CONFIG=PATH`` where that named it)."""
    given = given or f"--config {path}"
    try:
        with path.open("rb") as handle:
            table = tomllib.load(handle)
    except FileNotFoundError:
        raise SettingsRefused(f"{given}: the file does not exist", hint="check the path") from None
    except OSError as error:
        raise SettingsRefused(f"{given} cannot be read ({error.strerror})", hint="give a TOML file") from None
    except tomllib.TOMLDecodeError as error:
        raise SettingsRefused(f"{given} is not valid TOML", str(error), "fix the line it names") from None
    except UnicodeDecodeError as error:  # TOML is UTF-8 text: a binary file, or one saved in another encoding
        raise SettingsRefused(f"{given} is not UTF-8 text", f"byte {error.object[error.start]:#04x} at offset "
                              f"{error.start} is not UTF-8, and TOML files are.", "save it as UTF-8") from None  # fmt: skip
    table = table.get("run", table)  # settings may sit at the top or under [run]
    if not isinstance(table, dict):
        raise SettingsRefused(f"{given}: 'run' must be a table of settings ([run])", hint="see phalanx run --help")
    settings: dict[str, object] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in _BY_FIELD:
            known = ", ".join(option.flag for option in LAUNCH_OPTIONS)
            raise SettingsRefused(f"{given}: unknown setting {key!r}", f"known settings: {known}", "fix or remove it")
        settings[name] = value
    return settings


def resolve_settings(
    flags: Mapping[str, object], environ: Mapping[str, str], config: Mapping[str, object], config_path: Path | None
) -> dict[str, Resolved]:
    """Typed values for every setting that any source gives, highest-precedence source first."""
    resolved: dict[str, Resolved] = {}
    for option in LAUNCH_OPTIONS:
        sources = [(flags.get(option.field), f"--{option.flag}")]
        for variable in (option.torchrun_var, option.env_var):
            if variable is not None and variable in environ:
                sources.append((environ[variable], f"{variable}={environ[variable]}"))
        sources.append((config.get(option.field), f"{option.flag} in {config_path}"))
        for raw, origin in sources:
            if raw is None:
                continue
            try:
                resolved[option.field] = Resolved(option.parse(raw), origin)
            except values.InvalidValue as invalid:
                raise SettingsRefused(invalid.why + values.given_as(origin), hint=invalid.hint) from None
            break
    return resolved


@contextlib.contextmanager
def blaming(origin: str) -> Iterator[None]:
    """Within, a refusal of one setting's value (a check against this host: its interfaces, its
    folders) names ``origin``, where the value came from, as a refusal by its parser does."""
    try:
        yield
    except SettingsRefused as refused:
        raise SettingsRefused(refused.what + values.given_as(origin), refused.why, refused.hint) from None


#: The variable every command reads the config file's path from when --config is not given.
CONFIG_VARIABLE = ENV_PREFIX + "CONFIG"


class GivenSettings(NamedTuple):
    """A command's launch settings as given, with the config file they were read from."""

    settings: dict[str, Resolved]  # by field: each given one, with where it came from
    config_path: Path | None  # --config, else $PHALANX_CONFIG, else None
    config: dict[str, object]  # that file's settings


def read_config(config_flag: str | None, environ: Mapping[str, str]) -> tuple[Path | None, dict[str, object]]:
    """The config file every command reads, and its settings: --config, else $PHALANX_CONFIG, else
    none (no settings). Refusals name the one that named the file."""
    if config_flag is not None:
        text, given = config_flag, f"--config {config_flag}"
    else:
        text = environ.get(CONFIG_VARIABLE, "")
        given = f"{CONFIG_VARIABLE}={text}"
    if not text:
        return None, {}
    return Path(text), read_config_file(Path(text), given)


def given_settings(
    args: argparse.Namespace, environ: Mapping[str, str], variables: Mapping[str, str] | None = None
) -> GivenSettings:
    """The launch options a command was given: flags > PET_<FLAG> > PHALANX_<FLAG> > config file.

    Every command that starts a job (run, launch, slurm, k8s) resolves its settings here, so the
    same flags, variables and config file give the same job whichever command starts it.
    ``PHALANX_CONFIG`` is read from ``environ``, ``PET_``/``PHALANX_<FLAG>`` from ``variables``,
    those the nodes will see (default ``environ``; `phalanx k8s` gives the pods' ``--env``).
    """
    config_path, config = read_config(args.config, environ)
    flags = {option.field: getattr(args, option.field) for option in LAUNCH_OPTIONS}
    settings = resolve_settings(flags, environ if variables is None else variables, config, config_path)
    return GivenSettings(settings, config_path, config)
