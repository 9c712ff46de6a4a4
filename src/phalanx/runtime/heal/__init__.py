"""Healing: the ranks that survive a failure keep their processes, and a replacement rank joins them.

When a rank dies, the survivors' gradient all-reduce fails. In heal mode it fails inside
phalanx's communication hook (:mod:`.hook`), which notes the step as failed and lets the backward
finish; the optimizer's step is skipped (:func:`.hook.skip_failed_steps`), so the survivors still
hold the state after the last completed step. At :meth:`phalanx.Run.step` they leave the broken
process group and form the next generation of it on the job's store (:mod:`.generations`) with the
replacement rank that the dead rank's launcher started; the lowest surviving rank sends that state
to the replacement over the new generation's transfer group (:mod:`.transfer`), and every rank
trains the failed step again with the same batches: the result is the uninterrupted run's.

DDP itself runs over a group of one rank, which never fails, with its buckets never rebuilt
(``find_unused_parameters=True``): a replacement's buckets are then laid out as the survivors',
which an all-reduce across them needs. Only the hook talks across ranks.
"""
