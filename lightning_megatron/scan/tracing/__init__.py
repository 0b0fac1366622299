"""MegaScan's tracing: what runs inside a fit (needs torch, Lightning and megatron-core).

* ``callback``: the ``MegaScan`` callback: which steps are traced, the rank files, the report at fit end;
* ``recorder``: spans timed by CUDA events (or the host clock on CPUs), written as Trace Event records;
* ``clock``: each rank's clock offset to rank 0's; ``collectives``: torch.distributed collectives as spans;
* ``layers``: transformer layer parts as spans (``granularity="layer"``);
* ``busy``: GPU busy time per span from a CUDA-only profiler session; ``sched``: the training thread's waits for
  a CPU; ``profile``: full torch.profiler traces of chosen steps; ``online``: detection during the fit.

The rank files it writes are read by ``scan.analysis`` alone, which imports nothing from here.
"""
