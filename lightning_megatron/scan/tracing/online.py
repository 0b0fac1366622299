"""Detection during the fit: MegaScan's rules over a sliding window of recent steps, every few traced windows.

The contract: ``OnlineDetection(detect_steps, start_step, detect_options, on_detect)``; every rank calls
``run(trainer, trace_dir, step)`` at the same step, after the window's rank files are flushed, and gets the same
answer: whether training should stop. Rank 0 alone reads the files (only the last ``detect_steps`` steps, so memory stays
bounded however long the run), writes the report (``write_report``), prints the suspects that appeared and the
ranks that recovered since the last detection, logs both to the Trainer's logger, and calls ``on_detect``.

A week-long run cannot wait for fit end to learn that a GPU slowed down on day two; this is the watch kept while
it runs. Why the callback keeps it apart: it is the only part of MegaScan that reads traces back during training,
synchronises the ranks for it, and calls user code.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl

from lightning_megatron.scan.analysis.report import REPORT_FILE

__all__ = ["OnlineDetection", "write_report"]


def write_report(trace_dir: Path, report: Any) -> None:
    """``megascan-report.json`` (``DetectionReport.from_json`` reads it back), replaced whole: a reader never sees
    half a report, and the latest detection (online, then the fit-end one) is what it holds."""
    path = trace_dir / REPORT_FILE
    partial = path.with_suffix(".json.partial")
    partial.write_text(report.to_json())
    partial.replace(path)


class OnlineDetection:
    """Detection over the last ``detect_steps`` steps on rank 0, with what appeared and recovered (module doc)."""

    def __init__(
        self,
        detect_steps: int,
        start_step: int,
        detect_options: dict[str, Any],
        on_detect: Optional[Callable[[Any, pl.Trainer], Optional[bool]]],
    ) -> None:
        self.detect_steps, self.start_step = detect_steps, start_step
        self.detect_options, self.on_detect = detect_options, on_detect
        self.history: list[dict[str, Any]] = []
        """``{"step", "report", "appeared", "recovered"}`` per detection (rank 0)."""
        self._suspected: set[tuple[int, str]] = set()

    def run(self, trainer: pl.Trainer, trace_dir: Path, step: int) -> bool:
        """Detect now (every rank calls this at the same step); True on every rank when training should stop."""
        trainer.strategy.barrier("megascan-online")  # every rank's window is on disk
        stop = False
        if trainer.is_global_zero:
            report = self._detect(trace_dir, step)
            appeared, recovered = self._changes(report, step)
            self._announce(report, appeared, recovered, step)
            if trainer.logger is not None:
                from lightning_megatron.scan.analysis.report import log_to

                log_to(trainer.logger, report, step)
                if recovered:
                    trainer.logger.log_metrics({"megascan/recovered": float(len(recovered))}, step=step)
            if self.on_detect is not None:
                stop = bool(self.on_detect(report, trainer))
        return bool(trainer.strategy.broadcast(stop, src=0))

    def _detect(self, trace_dir: Path, step: int) -> Any:
        from lightning_megatron.scan.analysis.detect import detect

        since = max(step - self.detect_steps + 1, self.start_step)
        report = detect(trace_dir, since_step=since, **self.detect_options)
        write_report(trace_dir, report)
        return report

    def _changes(self, report: Any, step: int) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
        now = {(s.rank, s.kind) for s in report.suspects}
        appeared, recovered = sorted(now - self._suspected), sorted(self._suspected - now)
        self._suspected = now
        self.history.append({"step": step, "report": report, "appeared": appeared, "recovered": recovered})
        return appeared, recovered

    @staticmethod
    def _announce(report: Any, appeared: list[tuple[int, str]], recovered: list[tuple[int, str]], step: int) -> None:
        for suspect in report.suspects:
            if (suspect.rank, suspect.kind) in appeared:
                lost = suspect.evidence.get("impact_ms")
                cost = f", {lost:.1f} ms lost per step" if lost is not None else ""
                print(
                    f"MegaScan at step {step}: rank {suspect.rank} is slow ({suspect.kind}, "
                    f"+{suspect.slowdown:.0%}{cost})",
                    flush=True,
                )
        for rank, kind in recovered:
            print(f"MegaScan at step {step}: rank {rank} recovered ({kind})", flush=True)
