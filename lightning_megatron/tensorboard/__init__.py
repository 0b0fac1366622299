"""MegaScan in TensorBoard: the ``megascan`` plugin (``tensorboard --logdir runs/``, tab "MegaScan").

``plugin.MegaScanPlugin`` is registered through the ``tensorboard_plugins`` entry point; ``runs`` reads the MegaScan
runs under the logdir (rank files, the saved detection report, the merged timeline); ``static/index.js`` is the
tab. Nothing here imports torch, Lightning or megatron-core, and this ``__init__`` imports nothing at all, so
TensorBoard's start stays fast.
"""
