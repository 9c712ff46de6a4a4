"""The launcher: user input -> LaunchSpec -> per-node plan -> torchrun's elastic agent.

Modules, in the order data flows through them:

- :mod:`.values` and :mod:`.spec`: typed, validated settings (:class:`LaunchSpec`);
- :mod:`.options`: where settings come from (flags > ``PHALANX_*`` variables > TOML > defaults);
- :mod:`.network`: which local address and interface reach the endpoint, and who hosts the store;
- :mod:`.plan`: what one node agent runs (:class:`NodePlan`), and the decision block it prints;
- :mod:`.torchrun`: a node plan as torchrun's argv and environment;
- :mod:`.agent`: runs one node: the lobby, then torchrun's agent in this process;
- :mod:`.lobby`: join progress and the cross-node settings check, on the rendezvous store;
- :mod:`.logs`, :mod:`.rank_plan`, :mod:`.failure`: per-rank logs, the rank table, the root cause;
- :mod:`.simulate`: K node agents on this host.

Nothing here imports torch at module level; :mod:`.agent` imports torch.distributed.run only
when a node actually starts.
"""
