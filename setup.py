"""The one thing ``pyproject.toml`` cannot declare stably: the compiled row kernels
(``src/exactstep/rows/kernels.c``, loaded through ``ctypes`` by ``rows.kernels``).
The build records the source's SHA-256 in the library, so that ``rows.kernels``
refuses a library built from another ``kernels.c`` than the one beside it."""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "src/exactstep/rows/kernels.c"
DIGEST = hashlib.sha256((Path(__file__).resolve().parent / SOURCE).read_bytes()).hexdigest()

setup(ext_modules=[Extension("exactstep.rows._kernels", [SOURCE],
                             define_macros=[("KERNELS_SOURCE_SHA256", f'"{DIGEST}"')],
                             extra_compile_args=["-O3", "-std=c11", "-fno-wrapv"])])
