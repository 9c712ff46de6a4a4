"""A rank's part in healing: its generations of the group, its step's health, its role."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from phalanx.runtime.heal.generations import Generations
from phalanx.runtime.heal.hook import PeerFailed, StepHealth, all_reduce_or_note, share_buffers, skip_failed_steps
from phalanx.runtime.heal.transfer import receive_state, send_state
from phalanx.runtime.survivor import described
from phalanx.torch_compat import update_ddp_group


@dataclass(frozen=True)
class Healed:
    """One heal as this rank saw it."""

    #: The group's generation it formed.
    generation: int
    #: The step every rank goes on from: the last one that a survivor completed.
    step: int
    #: The rank whose state the receivers took (the others hold the same state already).
    source: int
    replaced: tuple[int, ...]
    #: The ranks the source sent its state to: the replacements, and survivors one step behind.
    receivers: tuple[int, ...]
    #: The bytes of tensors in the state (sent to each receiver).
    bytes_sent: int
    seconds: float
    #: Whether this rank had completed one step fewer (its step's all-reduce failed where the
    #: source's completed): it takes the source's whole state, and trains nothing again.
    behind: bool
    #: The ranks of the generation before, and of this one (fewer: a lost node's ranks left an
    #: elastic job; the ranks above are this generation's).
    world_before: int
    world_size: int

    @property
    def shrank(self) -> bool:
        return self.world_size < self.world_before

    def line(self) -> str:
        """What the heal did, for the run's log."""
        parts = [f"the lost node's ranks left, the world shrank from {self.world_before} to {self.world_size} ranks"
                 ] if self.shrank else []  # fmt: skip
        if self.replaced or not self.shrank:
            parts.append(f"rank(s) {', '.join(str(rank) for rank in self.replaced) or 'none'} replaced")
        if self.receivers:
            parts.append(f"{self.bytes_sent / 2**20:.1f} MiB of state from rank {self.source} to rank(s) "
                         f"{', '.join(str(rank) for rank in self.receivers)}")  # fmt: skip
        else:
            parts.append("no state sent (every rank held the last step's)")
        return f"phalanx: healed in {self.seconds:.1f} s (generation {self.generation}): {', '.join(parts)}; going on after step {self.step}"


class Healing:
    """This rank's healing: the generations of the job's group, the health of the step in
    progress, and whether this process replaces a rank that died.

    Args:
        generations: the job's group, generation by generation.
        replacement: whether this process replaces a rank that died (its launcher started it).
        device: this rank's device.
    """

    def __init__(self, generations: Generations, replacement: bool, device: torch.device) -> None:
        self.generations, self.replacement, self.device = generations, replacement, device
        self.health = StepHealth()
        self._ddp: DistributedDataParallel | None = None
        self._regroups: list[Callable[[], None]] = []
        self._releases: list[Callable[[], None]] = []

    def on_new_group(self, regroup: Callable[[], None], release: Callable[[], None]) -> None:
        """Calls ``release`` as this rank leaves a broken generation (its group is freed then, so
        a peer waiting on it learns that the connection closed), and ``regroup`` once it formed
        the next one for a heal, before the state is sent (not for the generation a replacement
        joins at its start: it makes what ``regroup`` makes itself)."""
        self._regroups.append(regroup)
        self._releases.append(release)

    def wrap(self, module: torch.nn.Module) -> DistributedDataParallel:
        """DDP over a group of this rank alone, its gradients averaged by the healing hook; the
        parameters and buffers start as rank 0's (a replacement receives them at its heal), and
        each forward starts with rank 0's buffers, as DDP's own broadcast would give them."""
        if not self.replacement:
            for tensor in (*module.parameters(), *module.buffers()):
                dist.broadcast(tensor.data, src=0)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=_solo_group(),
                                      find_unused_parameters=True)  # fmt: skip
        ddp.register_comm_hook(self.health, all_reduce_or_note)
        if any(True for _ in module.buffers()):  # where DDP would broadcast them (not in no_sync, not in eval)
            ddp.register_forward_pre_hook(
                lambda *_: share_buffers(module, self.health) if ddp.will_sync_module_buffers() else None
            )
        self._ddp = ddp
        return ddp

    def guard(self, stateful: Any) -> None:
        """An optimizer: its ``step()`` does nothing in a failed step. (Other objects a failed
        step changes, an LR scheduler, are rolled back to their state at the last mark.)"""
        if isinstance(stateful, torch.optim.Optimizer):
            skip_failed_steps(stateful, self.health)

    def heal(self, state_of_step: Any, step: int) -> tuple[dict[str, Any], Healed]:
        """After a failure (a survivor) or at the restore (a replacement): the next generation
        formed, then the state after the last step a survivor completed, from the lowest rank
        that completed it. A rank that fails in the exchange ends it on every rank, which heal
        again in the generation after, for as long as a generation may take to form.

        Args:
            state_of_step: builds this rank's state after its last completed step (a survivor).
            step: that step (a replacement: -1, it has none).

        Returns:
            The source's state (on a survivor that was not behind, its own: the same), and
            what the heal did.

        Raises:
            PeerFailed: the ranks did not heal within a generation's timeout.
            RuntimeError: no rank survived to heal from.
        """
        began, world_before = time.monotonic(), self.generations.world_size
        if not self.replacement:
            print(f"phalanx: a peer failed after step {step} ({described(self.health.failure)}); "
                  "keeping this process and healing", file=sys.stderr, flush=True)  # fmt: skip
        # A replacement formed its generation as it joined: what its watch noted since is news.
        formed, attempt = self.replacement, 1
        while True:
            if not formed:
                for release in self._releases:
                    release()
                self.generations.next_after_failure()
                for regroup in self._regroups:  # first: see _new_solo_group
                    regroup()
                self._new_solo_group()
                self.health.clear()  # from here on, a failure is one of the new generation's...
                self.generations.note_if_next_opened(self.health)  # ...which the watch may have noted
            formed = False
            try:
                return self._exchange(state_of_step, step, began, world_before)
            except PeerFailed as error:
                if time.monotonic() - began > self.generations.timeout.total_seconds():
                    raise PeerFailed(f"{error} (heal attempt {attempt}, {time.monotonic() - began:.0f} s)") from error
                print(f"phalanx: a rank failed during the heal ({described(self.health.failure)}); forming the "
                      f"process group again and healing again (attempt {attempt + 1})", file=sys.stderr,
                      flush=True)  # fmt: skip
                attempt += 1

    def _exchange(self, state_of_step: Any, step: int, began: float,
                  world_before: int) -> tuple[dict[str, Any], Healed]:  # fmt: skip
        """The heal in the generation just formed: each rank's role, then the source's state to
        the ranks that need it."""
        roles = torch.tensor([1 if self.replacement else 0, step], dtype=torch.int64, device=self.device)
        gathered = [torch.zeros_like(roles) for _ in range(dist.get_world_size())]
        self._wait([dist.all_gather(gathered, roles, async_op=True)])
        table = [(int(role[0].item()), int(role[1].item())) for role in gathered]
        survivors = [rank for rank, (replacing, _) in enumerate(table) if not replacing]
        if not survivors:
            raise RuntimeError("every rank is a replacement: no rank holds the state to heal from")
        target = max(table[rank][1] for rank in survivors)
        source = min(rank for rank in survivors if table[rank][1] == target)
        # The replacements, and the survivors one step behind; the others hold the source's state.
        receivers = [rank for rank, (replacing, done) in enumerate(table) if replacing or done < target]
        me = dist.get_rank()
        # The source's wait so far rides along: a replacement's own wait began only at its start.
        sent = torch.zeros(1, dtype=torch.int64, device=self.device)
        if me == source:
            box = {"payload": state_of_step(), "waited_s": time.monotonic() - began}
            sent += send_state(box, receivers, self._wait, self.generations.transfer)
        elif me in receivers:
            box = receive_state(source, self._wait, self.generations.transfer)
        else:
            box = {"payload": state_of_step()}
        self._wait([dist.broadcast(sent, src=source, async_op=True)])  # for every rank's line
        if self.replacement:
            began -= float(box["waited_s"])
        replaced = tuple(rank for rank, (replacing, _) in enumerate(table) if replacing)
        healed = Healed(self.generations.current, target, source, replaced, tuple(receivers), int(sent.item()),
                        time.monotonic() - began, not self.replacement and step < target, world_before,
                        dist.get_world_size())  # fmt: skip
        self.replacement = False  # a survivor from now on
        return box["payload"], healed

    def _wait(self, works: list[Any]) -> None:
        if not self.health.wait(works):
            raise PeerFailed(f"a rank failed during the heal: {described(self.health.failure)}")

    def _new_solo_group(self) -> None:
        """DDP's group, made after the generation's shared groups: torch names a group that is
        not local by a count of the groups made before it on that rank (the local ones count too
        since torch 2.14), so every rank makes its shared groups first and in one order, the
        order a replacement makes them in (the default group and its transfer group, as
        :meth:`.Generations._form` makes them; then each ``regroup``)."""
        if self._ddp is not None:
            update_ddp_group(self._ddp, _solo_group())


def _solo_group() -> dist.ProcessGroup:
    """A group of this rank alone: DDP's own collectives over it never fail."""
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)
