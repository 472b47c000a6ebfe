"""The one thing ``pyproject.toml`` cannot declare stably: the compiled row kernels
(``src/exactstep/rows/kernels.c``, loaded through ``ctypes`` by ``rows.kernels``)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("exactstep.rows._kernels", ["src/exactstep/rows/kernels.c"],
                             extra_compile_args=["-O3", "-std=c11", "-fno-wrapv"])])
