"""Healing: the ranks that survive a failure keep their processes, and a replacement rank joins them.

A failed all-reduce is noted in phalanx's communication hook (:mod:`.hook`) and the optimizer's
step skipped; at :meth:`phalanx.Run.step` the survivors form the next generation of the group
(:mod:`.generations`) with the replacement, send it their state (:mod:`.transfer`), and train the
failed step again (docs/runtime-design.md).
"""
