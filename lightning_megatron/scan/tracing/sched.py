"""How long the training thread waited for a CPU: the kernel's scheduler statistics, read at step boundaries.

The contract: ``RunDelay().read()`` gives the calling thread's run-queue delay so far (µs), or ``None`` where the
kernel keeps none (not Linux, ``CONFIG_SCHED_INFO`` off). The differences between two reads are what MegaScan
writes as ``cpu_wait_us`` on step and host-gap spans; ``scan.analysis.waits.cpu_waits`` reads them back.

Field 2 of ``/proc/thread-self/schedstat`` is the time the thread was runnable but not running: another process
took the CPU it may run on (time slices), or a CPU limit stopped its process (a container's CFS bandwidth
quota). A thread asleep in a blocking wait (a collective, a receive, a loader) is not runnable and adds nothing.
Span lengths cannot tell these apart from slow work: a compute span that lost half its time slices looks like a
slower GPU or CPU, and a host gap of a throttled process like more host work. This counter names the cause.

A read is one ``pread`` on a descriptor kept per thread (under a microsecond; reopening costs about 8 µs).
"""

from __future__ import annotations

import os
import threading
from typing import Optional

__all__ = ["RunDelay"]

_PATH = "/proc/thread-self/schedstat"


class RunDelay:
    """The calling thread's run-queue delay (µs), from a descriptor opened on first use by that thread."""

    def __init__(self) -> None:
        self._fd: Optional[int] = None
        self._thread: Optional[int] = None
        self._missing = False

    def read(self) -> Optional[float]:
        if self._missing:
            return None
        thread = threading.get_native_id()
        try:
            if self._fd is None or self._thread != thread:  # /proc/thread-self names the thread that opened it
                self.close()
                self._fd, self._thread = os.open(_PATH, os.O_RDONLY), thread
            fields = os.pread(self._fd, 128, 0).split()
            return int(fields[1]) / 1000.0
        except (OSError, IndexError, ValueError):
            self._missing = True
            self.close()
            return None

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
