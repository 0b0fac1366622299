"""Builds lightning_megatron.transport._native (C++17, pybind11; see native/README.md).

Everything else about the package is in pyproject.toml. The extension takes buffers as (address, bytes) and
never includes torch's headers, so the build needs no torch and one build works with any torch version."""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "native"))
from lmt_build import NativeBuildError, check_cxx, have_ibverbs  # noqa: E402

SOURCES = [
    "native/src/common.cpp",
    "native/src/buffer_pool.cpp",
    "native/src/mailbox.cpp",
    "native/src/ring.cpp",
    "native/src/copy_pool.cpp",
    "native/src/shm_channel.cpp",
    "native/src/tcp_channel.cpp",
    "native/src/tcp_handshake.cpp",
    "native/src/rdma_channel.cpp",
    "native/src/rdma_setup.cpp",
    "native/src/ucx_api.cpp",
    "native/src/ucx_channel.cpp",
    "native/src/ucx_device.cpp",
    "native/src/ucx_receive.cpp",
    "native/src/module.cpp",
]


class BuildNative(build_ext):
    def build_extensions(self):
        compile_cmd = list(self.compiler.compiler_so)
        link_cmd = list(getattr(self.compiler, "compiler_cxx", None) or self.compiler.linker_so)
        try:
            check_cxx(compile_cmd, link_cmd)
        except NativeBuildError as e:
            sys.stderr.write(f"\nerror: {e}\n\n")
            raise
        import pybind11

        rdma = have_ibverbs(compile_cmd, link_cmd)
        print(
            f"lightning_megatron native transport: RDMA {'enabled (rdma-core found)' if rdma else 'disabled (no <infiniband/verbs.h>; apt-get install libibverbs-dev to enable)'}"
        )
        for ext in self.extensions:
            ext.include_dirs.append(pybind11.get_include())
            if rdma:
                ext.define_macros.append(("LMT_HAVE_IBVERBS", "1"))
                ext.libraries.append("ibverbs")
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "lightning_megatron.transport._native",
            sources=SOURCES,
            depends=[
                os.path.join("native/src", f) for f in os.listdir(os.path.join(HERE, "native/src")) if f.endswith(".h")
            ],
            language="c++",
            extra_compile_args=["-std=c++17", "-O2", "-g0", "-pthread", "-fvisibility=hidden", "-Wall"],
            extra_link_args=["-pthread"],
            # UCX: compiled against the vendored headers, loaded with dlopen at run time (no link, no UCX needed
            # to build or import; see native/third_party/ucx/README.md).
            include_dirs=["native/third_party/ucx/include"],
            libraries=["rt", "dl"],
        )
    ],
    cmdclass={"build_ext": BuildNative},
)
