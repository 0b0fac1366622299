"""What every benchmark result records beside its figures: the exact command, the date, the device and the
versions of the software that produced them."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path
from typing import Any

__all__ = ["provenance"]


def provenance() -> dict[str, Any]:
    import lightning
    import megatron.core
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        import transformers

        hf = transformers.__version__
    except ImportError:
        hf = None
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{len(gpus)}x {gpus[0]}" if gpus else f"CPU ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None,
        "lightning": lightning.__version__,
        "megatron_core": megatron.core.__version__,
        "transformers": hf,
        "python": platform.python_version(),
    }
