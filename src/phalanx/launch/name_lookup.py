"""How long this machine takes to look up an address's name the way torch's store client does.

c10d's TCPStore client looks up the name of its own socket's address when a process first
connects, in its IPv4-mapped form (``::ffff:10.0.0.2``), which /etc/hosts never lists: the name
server is asked. Where that server does not answer, glibc waits out its timeout (5 s, twice, by
default) in every agent and worker of the job before its first store request.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time

#: Slower than this, a lookup waited out a name server's timeout: one that answers takes milliseconds.
SLOW_S = 0.5
#: The longest :func:`lookup_s` waits; a lookup still running then counts as this long.
LIMIT_S = 3.0
#: Lookups made at once, as a node's agent and workers connect together (some name servers drop
#: queries that come together).
AT_ONCE = 4

WHY = (
    "torch's store client looks up the name of its own address before its first request (in the IPv4-mapped "
    "form, which /etc/hosts never lists, so the name server is asked): every agent and worker of a job waits "
    "that long when it connects, and c10d warns 'The hostname of the client socket cannot be retrieved. err=-3'."
)


class Lookups:
    """Lookups of ``address``'s name, made as torch's store client makes it, each in a thread of
    its own (a lookup cannot be cancelled: a thread still waiting is left to end).

    Args:
        address: the address whose name is looked up: the one this node connects from.
        count: lookups made at once.
    """

    def __init__(self, address: str, count: int = AT_ONCE) -> None:
        self.mapped = mapped_form(address)
        self.started = time.monotonic()
        self._took: list[float] = []
        self._threads = [threading.Thread(target=self._look_up, name="phalanx-name-lookup", daemon=True)
                         for _ in range(count)]  # fmt: skip
        for thread in self._threads:
            thread.start()

    def _look_up(self) -> None:
        try:
            socket.getnameinfo((self.mapped, 0), socket.NI_NUMERICSERV)
        except OSError:  # no name, or the name server's timeout: either way the time is the fact
            pass
        finally:
            self._took.append(time.monotonic() - self.started)

    def running(self) -> bool:
        """Whether a lookup is still waiting for the name server."""
        return len(self._took) < len(self._threads)

    def wait(self, limit_s: float = LIMIT_S) -> float:
        """Seconds the slowest lookup took, waiting at most until ``limit_s`` after the start;
        ``limit_s`` when one is still waiting then."""
        for thread in self._threads:
            thread.join(max(0.0, self.started + limit_s - time.monotonic()))
        return limit_s if self.running() else min(max(self._took), limit_s)


def lookup_s(address: str = "127.0.0.1", limit_s: float = LIMIT_S) -> float:
    """Seconds the slowest of :data:`AT_ONCE` simultaneous lookups of ``address``'s name takes,
    at most ``limit_s``: milliseconds where the name server answers or none is configured, the
    resolver's timeout where one is configured but silent."""
    return Lookups(address).wait(limit_s)


def is_slow(seconds: float) -> bool:
    return seconds >= SLOW_S


def slow_text(seconds: float, address: str) -> str:
    """``looking up the name of 10.0.0.2 takes 5.0 s here`` (``at least`` at the probe's limit)."""
    bound = "at least " if seconds >= LIMIT_S else ""
    return (
        f"looking up the name of {address} takes {bound}{seconds:.1f} s here: the name server does not answer in time"
    )


def hint(address: str) -> str:
    return (
        f"make the name server in /etc/resolv.conf answer (`time getent hosts {mapped_form(address)}` shows the "
        "wait), or shorten its wait there (options timeout:1 attempts:1)"
    )


def mapped_form(address: str) -> str:
    """The form torch's client asks about: ``::ffff:10.0.0.2`` for an IPv4 address."""
    parsed = ipaddress.ip_address(address)
    return f"::ffff:{parsed}" if parsed.version == 4 else str(parsed)
