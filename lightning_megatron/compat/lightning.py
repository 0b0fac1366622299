"""The private Lightning APIs this project touches, in one place.

Lightning 2.6 keeps its script launcher private. It is the launcher Lightning's own
``ModelParallelStrategy`` and ``DDPStrategy`` use: it re-runs the script once per local rank, watches
the children and kills the survivors when one dies (without that, a crashed pipeline stage leaves its
peers blocked in a collective). Writing our own would duplicate tested Lightning code, so we import it
here and nowhere else; if a Lightning release moves it, this is the only file to change.

One more private name is touched elsewhere, because it is overridden rather than imported:
``RichProgressBar._get_train_description`` in ``lightning_megatron.display`` (the reason is stated there; if
Lightning renames it, the progress bar falls back to Lightning's own description).
"""

from __future__ import annotations

from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

__all__ = ["ScriptLauncher"]

ScriptLauncher = _SubprocessScriptLauncher
