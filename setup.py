"""Build settled's C extension; everything else is declared in pyproject.toml.

``settled.workspace._walk`` (the scanner's per-directory loop) is compiled by ``pip install
-e .`` with the machine's C compiler; a failed build fails the install (no silent fallback).
Its pure Python twin (``settled.workspace.walk``) stays complete: ``SETTLED_WALKER=python``.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "settled.workspace._walk",
            ["src/settled/workspace/_walk.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
            extra_link_args=["-pthread"],
        )
    ]
)
