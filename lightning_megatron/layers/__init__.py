"""Everything that rewrites megatron-core's tensor-parallel linear layers for a fit.

Why a package of its own: these modules change how ``ColumnParallelLinear`` and ``RowParallelLinear`` compute their
forward and backward; they are not pipeline schedules (a schedule decides the order of whole forwards and
backwards), though the zero-bubble schedules use the weight-gradient split.

* :mod:`.wgrad_accumulate`: where a backward of ours hands its weight gradient (computed now, or stashed as W);
* :mod:`.wgrad`: the B/W split (the layers' own backward, per instance, undone at teardown);
* :mod:`.collective_matmul` and :mod:`.tp_overlap`: tensor-parallel communication overlapped with the GEMMs;
* :mod:`.install`: what a fit installs in the layers (the split, the overlap, the symmetric-memory all-reduce of
  ``compat.symmetric_all_reduce``) and takes back at teardown.

FP8 linear layers belong here too when they come: another rewrite of the same layers, installed and restored the
same way.
"""
