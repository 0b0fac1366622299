"""Build-time checks for the native transport extension, used by ``setup.py`` (and unit-tested on their own).

Kept free of setuptools imports so a test can call them with any compiler command."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

__all__ = ["NO_COMPILER_HELP", "NativeBuildError", "check_cxx", "have_ibverbs"]

NO_COMPILER_HELP = (
    "lightning-megatron builds a C++17 extension (its native tensor transports) during installation and needs a "
    "C++ compiler for it. Install one -- Debian/Ubuntu: `apt-get install g++` (or `build-essential`); "
    "Fedora/RHEL: `dnf install gcc-c++`; conda: `conda install gxx_linux-64` -- then run `make setup` (or "
    "`pip install -e .`) again. To use another compiler, set CC and CXX."
)

_PROBE = '#include <atomic>\n#include <string>\nint lmt_probe() { std::atomic<int> a{1}; return a.load() + int(std::string("x").size()); }\n'
_IBVERBS_PROBE = (
    "#include <infiniband/verbs.h>\n"
    "int main() { int n = 0; ibv_device** d = ibv_get_device_list(&n); if (d) ibv_free_device_list(d); return 0; }\n"
)


class NativeBuildError(RuntimeError):
    """The extension cannot be built here; the message says what to install."""


def _run(cmd: list[str], cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def check_cxx(compile_cmd: list[str], link_cmd: list[str] | None = None) -> None:
    """Compile (and link, as a shared object) a small C++17 file with the commands the build will use.

    Raises :class:`NativeBuildError` naming the fix when the compiler is missing or cannot build C++17."""
    link_cmd = link_cmd or compile_cmd
    for cmd in (compile_cmd, link_cmd):
        if not cmd or shutil.which(cmd[0]) is None:
            raise NativeBuildError(
                f"no C++ compiler: `{cmd[0] if cmd else '(none)'}` was not found on PATH. {NO_COMPILER_HELP}"
            )
    with tempfile.TemporaryDirectory(prefix="lmt-build-") as tmp:
        with open(os.path.join(tmp, "probe.cpp"), "w") as f:
            f.write(_PROBE)
        steps = [
            [*compile_cmd, "-x", "c++", "-std=c++17", "-fPIC", "-c", "probe.cpp", "-o", "probe.o"],
            [*link_cmd, "-shared", "probe.o", "-o", "probe.so"],
        ]
        for step in steps:
            try:
                res = _run(step, tmp)
            except OSError as e:
                raise NativeBuildError(f"running `{step[0]}` failed ({e}). {NO_COMPILER_HELP}") from e
            if res.returncode != 0:
                tail = (res.stderr or res.stdout).strip()[-1500:]
                raise NativeBuildError(
                    f"the C++ compiler cannot build a C++17 shared library (`{' '.join(step)}` failed:\n{tail}\n). "
                    f"{NO_COMPILER_HELP}"
                )


def have_ibverbs(compile_cmd: list[str], link_cmd: list[str] | None = None) -> bool:
    """Whether rdma-core's <infiniband/verbs.h> and libibverbs are available (then RDMA is compiled in)."""
    link_cmd = link_cmd or compile_cmd
    with tempfile.TemporaryDirectory(prefix="lmt-build-") as tmp:
        with open(os.path.join(tmp, "probe.cpp"), "w") as f:
            f.write(_IBVERBS_PROBE)
        try:
            if _run([*compile_cmd, "-x", "c++", "-std=c++17", "-c", "probe.cpp", "-o", "probe.o"], tmp).returncode:
                return False
            return _run([*link_cmd, "probe.o", "-o", "probe", "-libverbs"], tmp).returncode == 0
        except OSError:
            return False
