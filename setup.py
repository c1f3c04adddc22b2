"""Build of the optional C extension edgetorch.codecs._native; all metadata is in pyproject.toml.

The extension is optional: without a C compiler the install still succeeds and the codecs fall
back to torch ops (slower; edgetorch warns once and says how to fix it). It needs no numpy or
torch headers. It is built for the baseline instruction set of the target (no -march): on
x86-64 an AVX2 copy of the hot loops is compiled alongside and chosen at run time.
"""

import sys

from setuptools import Extension, setup

if sys.platform == "win32":
    compile_args: list[str] = ["/O2"]  # POSIX threads are required: this build fails, which is allowed
    link_args: list[str] = []
else:
    # -ffp-contract=off: the quantized codec's kernels must round every float operation as its
    # torch reference does; a contracted (x - lo) * inv + 0.5 or lo + code * scale is one fused
    # multiply-add, rounded once, and flips codes at half-steps (clang contracts by default, and
    # its AVX-512 copy of the kernels may use FMA instructions).
    # -g0 and -s: Python's own build flags add -g, and the debug info made the module 5.5 MB of a
    # device install; stripped, it is the code alone.
    compile_args = ["-O3", "-g0", "-std=c99", "-fno-strict-aliasing", "-ffp-contract=off", "-Wall", "-Wextra",
                    "-Wno-unused-function", "-Wno-missing-field-initializers", "-pthread"]
    link_args = ["-pthread", "-s"] if sys.platform.startswith("linux") else ["-pthread"]

setup(
    ext_modules=[
        Extension(
            "edgetorch.codecs._native",
            sources=["src/edgetorch/codecs/_native.c"],
            depends=["src/edgetorch/codecs/_native_kernels.h", "src/edgetorch/codecs/_native_widths.h"],
            extra_compile_args=compile_args,
            extra_link_args=link_args,
            optional=True,
        )
    ],
)
