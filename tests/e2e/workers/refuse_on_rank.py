"""Rank REFUSE_RANK refuses its settings after the process group is up, as a node whose device
cannot do what was asked would (a SettingsRefused); the other ranks wait for it in an all-reduce
and fail when it is gone. Usage: refuse_on_rank.py REFUSE_RANK"""

import sys

import torch
import torch.distributed as dist

import phalanx
from phalanx.errors import SettingsRefused

refuse_rank = int(sys.argv[1])
context = phalanx.init()
if context.rank == refuse_rank:
    raise SettingsRefused(
        "a setting only this node cannot run", "this node lacks what it needs", "change it on this node"
    )
dist.all_reduce(torch.ones(1))
context.close()
