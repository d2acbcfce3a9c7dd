"""The one C extension: settled.boundary._linux, the Linux calls of a session owner's launch
path (boundary/_linux.c). Everything else is in pyproject.toml. A compiler error fails the
install (`pip install -e .`, scripts/setup): never a silent fallback at build time; at run
time, boundary/linux.py falls back to ctypes where the module is missing, and says so in every
receipt (owner.calls)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "settled.boundary._linux",
            ["src/settled/boundary/_linux.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ]
)
