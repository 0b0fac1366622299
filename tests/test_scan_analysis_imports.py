"""``scan.analysis`` is torch-free, as a package fact: every module of it, the ``scan`` package itself and the
TensorBoard plugin import in a fresh interpreter without torch, Lightning or megatron-core (the plugin starts with
TensorBoard, and machines that only read traces need none of them). ``scan.tracing`` needs torch and
``scan.evaluation`` may; ``scan.analysis`` imports neither.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import lightning_megatron.scan.analysis as analysis

MODULES = sorted(f"lightning_megatron.scan.analysis.{m.name}" for m in pkgutil.iter_modules(analysis.__path__))


def test_every_analysis_module_imports_without_torch() -> None:
    assert "lightning_megatron.scan.analysis.detect" in MODULES and len(MODULES) >= 15, MODULES
    imports = "\n".join(
        f"import {name}"
        for name in [
            "lightning_megatron.scan",
            "lightning_megatron.scan.analysis",
            *MODULES,
            "lightning_megatron.scan.cli",
            "lightning_megatron.tensorboard.plugin",
        ]
    )
    code = (
        "import sys\n"
        f"{imports}\n"
        "from lightning_megatron.scan import REPORT_FILE\n"
        "assert REPORT_FILE == 'megascan-report.json'\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'megatron'))\n"
        "assert 'torch' not in sys.modules and not heavy, heavy[:10]\n"
        "assert not [m for m in sys.modules if m.startswith(('lightning_megatron.scan.tracing', "
        "'lightning_megatron.scan.evaluation'))]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_callback_is_loaded_on_first_access_only() -> None:
    """``from lightning_megatron.scan import MegaScan`` still works (PEP 562): it is what loads torch."""
    code = (
        "import sys\n"
        "import lightning_megatron.scan as scan\n"
        "assert 'torch' not in sys.modules\n"
        "from lightning_megatron.scan import MegaScan\n"
        "assert 'torch' in sys.modules and MegaScan.__module__ == 'lightning_megatron.scan.tracing.callback'\n"
        "assert {'MegaScan', 'REPORT_FILE', 'SlowdownInjector', 'LinkDelayInjector'} <= set(dir(scan))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_analysis_imports_nothing_from_tracing_or_evaluation() -> None:
    """The boundary in the source, lazy imports inside functions included: every import of this package that a
    module of ``scan.analysis`` makes stays inside ``scan.analysis``."""
    for path in sorted(Path(analysis.__file__).parent.glob("*.py")):
        for line in path.read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] in ("from", "import") and words[1].startswith("lightning_megatron"):
                assert words[1].startswith("lightning_megatron.scan.analysis"), (path.name, line)
