"""The private Lightning APIs this project touches, in one place.

Lightning 2.6 keeps its script launcher private. It is the launcher Lightning's own
``ModelParallelStrategy`` and ``DDPStrategy`` use: it re-runs the script once per local rank, watches
the children and kills the survivors when one dies (without that, a crashed pipeline stage leaves its
peers blocked in a collective). Writing our own would duplicate tested Lightning code, so we import it
here and nowhere else; if a Lightning release moves it, this is the only file to change.

``announce_step_sync`` wraps ``_TrainingEpochLoop._broadcast_sigterm_tensor`` on the Trainer's own loop: the
synchronisation of every rank that Lightning runs once per batch, before the fetch. It is where a rank that is
late between steps keeps the others waiting, so step listeners are told about it (``step-sync``); if a Lightning
release renames it, nothing is wrapped and MegaScan falls back to comparing the gaps alone.

``announce_step_sync`` replaces a method on one Trainer's loop instance (never on the class); it is listed in
:mod:`.inventory` with the project's other replacements.

One more private name is touched elsewhere, because it is overridden rather than imported:
``RichProgressBar._get_train_description`` in ``lightning_megatron.display`` (the reason is stated there; if
Lightning renames it, the progress bar falls back to Lightning's own description).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

__all__ = ["ScriptLauncher", "announce_step_sync"]

ScriptLauncher = _SubprocessScriptLauncher


def announce_step_sync(trainer: Any, listeners: list[Any]) -> bool:
    """Tell ``listeners`` (the strategy's live list) ``span_start/stop("step-sync")`` around Lightning's per-batch
    synchronisation of the ranks, on this Trainer's loop only; False where this Lightning has no such method.
    Wrapping twice is a no-op."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    original = getattr(loop, "_broadcast_sigterm_tensor", None)
    if original is None or getattr(original, "announced_as_step_sync", False):
        return original is not None

    def announced() -> Any:
        told = list(listeners)
        for listener in told:
            listener.span_start("step-sync")
        try:
            return original()
        finally:
            for listener in reversed(told):
                listener.span_stop("step-sync")

    announced.announced_as_step_sync = True  # type: ignore[attr-defined]
    loop._broadcast_sigterm_tensor = announced  # type: ignore[union-attr]
    return True
