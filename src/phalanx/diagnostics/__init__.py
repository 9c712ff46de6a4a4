"""Diagnostics: what each machine is, and whether the machines of one job fit together.

- the env report (`phalanx env`): this machine's facts as one JSON-serialisable document
  (:mod:`.env_report`, collected by :mod:`.machine`, :mod:`.torch_facts` and
  :mod:`.launch_settings`, known traps flagged by :mod:`.traps`, printed by :mod:`.env_text`);
- fingerprints: the subset of that report worth comparing across nodes
  (:func:`.env_report.comparable_facts`);
- the doctor (`phalanx doctor`): a short distributed job that gathers every rank's fingerprint
  and measures the links between the nodes.

Importing this package is cheap: torch is imported only when the torch facts are collected.
"""
