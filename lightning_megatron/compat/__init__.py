"""Workarounds for private or missing APIs of other projects, one module per problem, each with its reason.

Every replacement of another project's function is made here (the one exception, MegaScan's tracing of
``torch.distributed``'s collectives, lives with the tracer) and listed in :mod:`.inventory`: what it replaces, why,
how it is restored and the versions it was tested with."""
