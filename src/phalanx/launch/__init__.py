"""The launcher: user input -> LaunchSpec -> per-node setup -> torchrun's elastic agent.

Modules, in the order data flows through them:

- :mod:`.values` and :mod:`.spec`: typed, validated settings (:class:`LaunchSpec`);
- :mod:`.options`: where settings come from (flags > ``PET_*`` > ``PHALANX_*`` variables > TOML >
  the cluster environment > defaults), and :mod:`.cluster`: what the cluster environment
  (:mod:`phalanx.clusters`) gives and what contradicts it;
- :mod:`.network`: which local address and interface reach the endpoint, and who hosts the store;
- :mod:`.node_setup`: what one node agent runs (:class:`NodeSetup`), and the decision block it prints;
- :mod:`.torchrun`: a node setup as torchrun's argv and environment;
- :mod:`.agent`: runs one node: the lobby, then torchrun's agent in this process;
- :mod:`.lobby`: join progress and the cross-node settings check, on the rendezvous store;
- :mod:`.logs`, :mod:`.rank_table`, :mod:`.failure`: per-rank logs, the rank table, the root cause;
- :mod:`.simulate`: K node agents on this host;
- :mod:`.signals`: processes that die with their launcher, and signals passed on to them;
- :mod:`.bootstrap` and :mod:`.group_record`: every worker's entry point, which runs the user's
  script and records whether it joined the job's process group.

Nothing here imports torch at module level; :mod:`.agent` imports torch.distributed.run only
when a node actually starts.
"""
