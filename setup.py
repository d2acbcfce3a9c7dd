"""Build settled's two C extensions; everything else is declared in pyproject.toml.

- ``settled.boundary._linux`` (boundary/_linux.c): the Linux calls of a session owner's launch
  path. At run time boundary/linux.py falls back to ctypes where the module is missing, and
  says so in every receipt (owner.calls).
- ``settled.workspace._walk`` (workspace/_walk.c): the scanner's per-directory loop. Its pure
  Python twin (``settled.workspace.walk``) stays complete: ``SETTLED_WALKER=python``.

Both are compiled by ``pip install -e .`` (scripts/setup) with the machine's C compiler, and a
compiler error fails the install: never a silent fallback at build time.
"""

from setuptools import Extension, setup

WARNINGS = ["-O2", "-Wall", "-Wextra"]

setup(
    ext_modules=[
        Extension(
            "settled.boundary._linux",
            ["src/settled/boundary/_linux.c"],
            extra_compile_args=[*WARNINGS, "-Wno-unused-parameter"],
        ),
        Extension(
            "settled.workspace._walk",
            ["src/settled/workspace/_walk.c"],
            extra_compile_args=[*WARNINGS, "-Wno-missing-field-initializers"],
            extra_link_args=["-pthread"],
        ),
    ]
)
