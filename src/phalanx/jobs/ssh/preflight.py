"""``phalanx launch``'s preflight: every host asked at once, over ssh, within a time bound, whether
the job can start there (the checks are listed in docs/clusters.md); one table of the answers,
and a refusal naming each host that cannot. The first host listens on the rendezvous port
meanwhile (which proves it free there), answering with a token, so that a connection that
reaches some other program does not count.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
import select
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from phalanx import __version__
from phalanx.console import format_table
from phalanx.errors import SettingsRefused
from phalanx.jobs.ssh.hosts import SshHost
from phalanx.jobs.ssh.transport import SSH_FAILED, Ssh, probe_command

if TYPE_CHECKING:
    from phalanx.jobs.ssh.job import SshJob

#: The preflight table's columns: the host, then the keys of each check's cells.
COLUMNS = ("host", "ssh", "python", "phalanx", "torch", "files", "gpus", "route to first host", "rendezvous port")


@dataclass
class HostCheck:
    """One host's answers (``cells``, the table's row) and what cannot work there (what, hint)."""

    host: SshHost
    cells: dict[str, str] = field(default_factory=dict)
    problems: list[tuple[str, str]] = field(default_factory=list)
    facts: dict[str, Any] | None = None

    def refuse(self, what: str, hint: str) -> None:
        self.problems.append((what, hint))


@dataclass
class Preflight:
    """The preflight's outcome: a check per host, the endpoint every host reached, its duration."""

    checks: list[HostCheck]
    endpoint: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.endpoint is not None and not any(check.problems for check in self.checks)

    def table(self) -> str:
        rows = [[check.host.label, *(check.cells.get(column, "-") for column in COLUMNS[1:])] for check in self.checks]
        return format_table(COLUMNS, rows)

    def refusal(self) -> SettingsRefused:
        failing = [check for check in self.checks if check.problems]
        lines = [f"{check.host.label}: {what}\n  HINT: {hint}" for check in failing for what, hint in check.problems]
        names = ", ".join(check.host.label for check in failing) or "the first host"
        return SettingsRefused(
            f"the preflight found hosts where the job cannot start: {names}; nothing was started",
            "\n".join(lines) or "no address of the first host was reachable from every host.",
            "fix what each host's HINT says, then launch again (--dry-run runs the preflight alone)",
        )


def run_preflight(job: SshJob, ssh: Ssh, timeout_s: float) -> Preflight:
    """Asks every host of the job in parallel (the first will host the rendezvous) whether it can
    start there; returns within about ``timeout_s`` whatever the hosts do. The :class:`Preflight`
    is ``ok`` when the job can start, with the endpoint every host reached."""
    hosts = job.hosts
    started = time.monotonic()
    deadline = started + timeout_s
    checks = [HostCheck(host) for host in hosts]
    token = secrets.token_hex(8)
    listen = probe_command(job.python, "listen", {"port": job.port, "token": token}, job.environment)
    listener = subprocess.Popen(ssh.argv(hosts[0].name, listen), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        facts = probe_command(job.python, "facts", {"cwd": job.cwd, "files": list(job.files)}, job.environment)
        answers = _on_every_host(hosts, ssh, facts, deadline)
        for check, answer in zip(checks, answers):
            _read_facts(check, answer, job)
        _compare_hosts(checks, job)
        endpoint = None
        if not checks[0].problems and _listening(listener, checks[0], job.port, deadline):
            candidates = _candidates(hosts[0], ssh, checks[0].facts or {}, job.endpoint_host)
            request = {"candidates": candidates, "port": job.port, "token": token}
            reach = probe_command(job.python, "reach", request, job.environment)
            reachable = [check for check in checks if check.facts is not None]
            # a round of its own, however long the first took: a connect may take its 3 s
            answers = _on_every_host(
                [check.host for check in reachable], ssh, reach, max(deadline, time.monotonic() + 10)
            )
            endpoint = _read_reach(reachable, answers, candidates, job.port)
    finally:
        _close(listener, deadline)
    return Preflight(checks, endpoint, time.monotonic() - started)


@dataclass(frozen=True)
class _Answer:
    code: int | None  # None: no answer within the deadline
    stdout: str
    stderr: str


def _on_every_host(hosts: Sequence[SshHost], ssh: Ssh, command: str, deadline: float) -> list[_Answer]:
    def ask(host: SshHost) -> _Answer:
        try:
            done = subprocess.run(ssh.argv(host.name, command), stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=max(0.1, deadline - time.monotonic()))  # fmt: skip
        except subprocess.TimeoutExpired as expired:
            return _Answer(None, _text(expired.stdout), _text(expired.stderr))
        return _Answer(done.returncode, done.stdout, done.stderr)

    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=min(64, len(hosts))) as pool:
        return list(pool.map(ask, hosts))


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def _json_line(answer: _Answer) -> dict[str, Any] | None:
    for line in reversed(answer.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


#: ssh's words for a host it could not reach at all, and what to do; a refused login gets the general HINT.
_SSH_HINTS = (
    ("Could not resolve hostname", "check the host's name, or give its address; or add the name to /etc/hosts, DNS "
                                   "or a Host entry of ~/.ssh/config (or --ssh-config)"),
    ("Connection refused", "the host is up, but no sshd listens on that port: start it, or give the port in "
                           "~/.ssh/config (or --ssh-config)"),
    ("timed out", "the host did not answer: check that it is up and reachable from here (a firewall may drop ssh)"),
    ("No route to host", "this host has no route to it: check the address and the network between them"),
)  # fmt: skip


def _read_facts(check: HostCheck, answer: _Answer, job: SshJob) -> None:
    name = check.host.label
    if answer.code is None:
        check.cells["ssh"] = "no answer"
        check.refuse(
            "did not answer in time", f"check that it is up and that `ssh {check.host.name} true` returns at once"
        )
        return
    if answer.code == SSH_FAILED:
        check.cells["ssh"] = "failed"
        said = _last_line(answer.stderr)
        hint = next((hint for words, hint in _SSH_HINTS if words in said), None)
        check.refuse(f"ssh failed: {said}", (hint or
                     f"`ssh {check.host.name} true` must work without a question: a key (ssh-copy-id), the host "
                     "in known_hosts, the user and port in ~/.ssh/config (or --ssh-config)"))  # fmt: skip
        return
    check.cells["ssh"] = "ok"
    facts = _json_line(answer)
    if facts is None:
        check.cells["python"] = "missing" if answer.code in (126, 127) else "failed"
        check.refuse(f"{job.python} did not run there ({_last_line(answer.stderr)})",
                     f"install the same environment on {name}, or name its Python with --remote-python PATH")  # fmt: skip
        return
    check.facts = facts
    check.cells["python"] = facts["python"]
    check.cells["phalanx"] = facts["phalanx"] or "missing"
    check.cells["torch"] = facts["torch"] or "missing"
    check.cells["gpus"] = str(facts["gpus"])
    if facts["phalanx"] != __version__:
        check.refuse(f"phalanx {facts['phalanx'] or 'is not installed'} (this machine has {__version__})",
                     f"install phalanx {__version__} into {job.python} on {name}")  # fmt: skip
    if facts["torch"] is None:
        check.refuse("torch is not installed", f"install the torch of the other hosts into {job.python} on {name}")
    if "cwd_error" in facts:
        check.cells["files"] = "no folder"
        check.refuse(f"the working folder {job.cwd} is missing ({facts['cwd_error']})",
                     "every host runs in this same folder: put the project there (rsync, or a shared file system), "
                     "or launch from a folder every host has")  # fmt: skip
        return
    _compare_files(check, facts["files"], job)


def _compare_files(check: HostCheck, found: dict[str, str], job: SshJob) -> None:
    differ = []
    for path, ours in job.files.items():
        theirs = found.get(path, "error: no answer")
        if theirs.startswith("error: "):
            check.refuse(
                f"{path} cannot be read there ({theirs[7:]})", f"copy it: scp {path} {check.host.name}:{job.cwd}/"
            )
            differ.append(path)
        elif ours is not None and theirs != ours:
            check.refuse(f"{path} differs from this machine's (SHA-256 {theirs[:12]} there, {ours[:12]} here)",
                         f"copy it: scp {path} {check.host.name}:{job.cwd}/ (or rsync the project)")  # fmt: skip
            differ.append(path)
    check.cells["files"] = "ok" if not differ else "differ"


def _compare_hosts(checks: list[HostCheck], job: SshJob) -> None:
    """The versions and files of every host against the first that answered; GPUs against nproc."""
    answered = [check for check in checks if check.facts is not None]
    if not answered:
        return
    first = answered[0]
    reference = first.facts or {}
    for check in answered[1:]:
        facts = check.facts or {}
        if _minor(facts["python"]) != _minor(reference["python"]):
            check.refuse(f"Python {facts['python']}, {first.host.label} has {reference['python']}",
                         "every host needs the same Python (major.minor): pickled state and torch builds depend on it")  # fmt: skip
        if facts["torch"] and reference["torch"] and facts["torch"] != reference["torch"]:
            check.refuse(f"torch {facts['torch']}, {first.host.label} has {reference['torch']}",
                         f"install torch=={reference['torch']} on every host")  # fmt: skip
        for path, ours in job.files.items():  # a file that is not here: every host's must match the first's
            if ours is None and facts["files"].get(path) != reference["files"].get(path) and "cwd_error" not in facts:
                check.refuse(f"{path} differs from {first.host.label}'s", f"copy the same {path} to every host")
                check.cells["files"] = "differ"
    with_gpus = [check.host.label for check in answered if (check.facts or {})["gpus"] > 0]
    nproc = job.nproc
    for check in answered:
        gpus = (check.facts or {})["gpus"]
        if nproc.isdigit() and gpus and int(nproc) > gpus:
            check.refuse(f"{gpus} GPUs, for {nproc} processes", f"ask for at most {gpus} processes on it (slots or "
                         "--nproc-per-node), one per GPU")  # fmt: skip
        elif nproc == "gpu" and not gpus:
            check.refuse("no GPU, and --nproc-per-node gpu", "run on hosts with GPUs, or give a number of processes")
        elif with_gpus and not gpus:
            check.refuse(f"no GPU, while {', '.join(with_gpus)} have GPUs",
                         "one job's hosts train alike: all on GPUs (nccl) or all on CPUs (gloo)")  # fmt: skip


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _listening(listener: subprocess.Popen[str], first: HostCheck, port: int, deadline: float) -> bool:
    """Whether the first host's listener holds the rendezvous port; says why not."""
    assert listener.stdout is not None
    ready, _, _ = select.select([listener.stdout], [], [], max(0.0, deadline - time.monotonic()))
    line = listener.stdout.readline() if ready else ""
    answer = json.loads(line) if line.startswith("{") else {"error": "no answer in time"}
    if answer.get("listening"):
        return True
    first.cells["rendezvous port"] = "in use" if "in use" in answer["error"] else "failed"
    first.refuse(f"cannot listen on the rendezvous port {port} ({answer['error']})",
                 f"find what holds it there (ss -ltnp 'sport = :{port}'), or pick another port with "
                 "--rdzv-endpoint HOST:PORT")  # fmt: skip
    return False


def _candidates(first: SshHost, ssh: Ssh, facts: dict[str, Any], endpoint_host: str | None) -> list[str]:
    """The first host's addresses, in the order they are tried: the user's endpoint alone if given;
    else the address ssh reaches it by, then the addresses it has."""
    if endpoint_host:
        return [endpoint_host]
    found = list(dict.fromkeys([ssh.resolved_hostname(first.name) or first.label, *facts.get("addresses", [])]))
    return sorted(found, key=_is_global)  # private addresses first: phalanx run refuses a public endpoint


def _is_global(candidate: str) -> bool:
    try:
        return ipaddress.ip_address(candidate).is_global
    except ValueError:
        return False  # a name: where it resolves is the hosts' business


def _read_reach(checks: list[HostCheck], answers: list[_Answer], candidates: list[str], port: int) -> str | None:
    results: list[dict[str, dict[str, Any]]] = []
    for check, answer in zip(checks, answers):
        found = _json_line(answer)
        if found is None:
            check.cells["rendezvous port"] = "no answer"
            check.refuse("did not answer the reachability probe in time", "check its network and load")
            results.append({})
            continue
        results.append({item["candidate"]: item for item in found["reach"]})
    owned = _owned_by_first_host(checks[0], results[0], candidates)
    endpoint = next((c for c in owned if all(r.get(c, {}).get("connect") == "ok" for r in results)), None)
    if results[0] and not owned:
        addresses = ", ".join((checks[0].facts or {}).get("addresses", [])) or "none"
        checks[0].refuse(f"the endpoint {candidates[0]} is not this host's address (its addresses: {addresses})",
                         "the first host runs the rendezvous store, so the endpoint must be its own address: "
                         "leave --rdzv-endpoint out, or name the host it belongs to first")  # fmt: skip
    shown = endpoint or candidates[0]
    for check, result in zip(checks, results):
        item = result.get(shown)
        if item is None:
            continue
        route = item.get("route") or {}
        check.cells["route to first host"] = (
            f"{route.get('device') or '?'} ({route.get('source')})" if "source" in route else route.get("error", "none")
        )
        check.cells["rendezvous port"] = item["connect"]
        if endpoint is None and item["connect"] != "ok":
            check.refuse(f"cannot reach the rendezvous port {shown}:{port}: {item['connect']}",
                         f"open TCP port {port} towards the first host (a firewall?), or pick a port that is "
                         "open with --rdzv-endpoint HOST:PORT")  # fmt: skip
    return endpoint


def _owned_by_first_host(first: HostCheck, result: dict[str, dict[str, Any]], candidates: list[str]) -> list[str]:
    """The candidates that resolve, on the first host, to an address it has (or to loopback): a
    NAT's or a port forward's address reaches its listener too, but phalanx run there would not
    know that it hosts the store."""
    own = set((first.facts or {}).get("addresses", []))
    addresses = {candidate: str(result.get(candidate, {}).get("address", "")) for candidate in candidates}
    return [candidate for candidate, address in addresses.items() if address in own or address.startswith("127.")]


def _close(listener: subprocess.Popen[str], deadline: float) -> None:
    """Ends the first host's listener: it leaves when its stdin closes, but a host that never
    answered holds it past the preflight's bound, which it may not outlast by more than a moment."""
    try:
        if listener.stdin is not None:
            listener.stdin.close()
        listener.wait(timeout=max(0.2, min(5.0, deadline - time.monotonic())))
    except (OSError, subprocess.TimeoutExpired):
        listener.kill()
        listener.wait()
