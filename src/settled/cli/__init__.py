"""The `settled` command line's entry point: answers `--version` at once, runs the read verbs'
plain command lines without argparse (`cli/reads.py`), and hands everything else to
`settled.cli.verbs` (the handlers; their parser is `cli/parser.py`; contract in DESIGN.md).

It exists so that what costs nothing stays free: a script that asks for the version, or an
agent's hundredth `settled status`, pays only for the modules its verb needs (the verbs module
loads the runtime lazily too; bench/startup.py measures it, tests/test_startup.py holds it).
A strict stdout is made to print a name's byte that is not UTF-8 as ``\\udcXX``, not to fail.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _main(argv)
    except BrokenPipeError:  # a help or a version piped into `head`: a quiet 141
        from settled.cli.frame import broken_pipe

        return broken_pipe()


def _main(argv: list[str]) -> int:
    _tolerant_stdout()
    if argv in (["--version"], ["-V"]):
        from settled import __version__

        print(f"settled {__version__}")
        return 0
    from settled.cli.thin import answered_by_home

    code = answered_by_home(argv)
    if code is not None:
        return code
    return run_here(argv)


def _tolerant_stdout() -> None:
    """A strict stdout ends a human view at the first name that is not UTF-8 (its bytes are
    lone surrogates, as ``os.fsdecode`` made them): such a character is printed as its escape
    ``\\udcXX`` instead. Set before the warm process is asked, which takes the same errors."""
    out = sys.stdout
    if getattr(out, "errors", None) == "strict" and hasattr(out, "reconfigure"):
        out.reconfigure(errors="backslashreplace")


def run_here(argv: list[str]) -> int:
    """The verb, in this process: what a worker of the home's warm process runs too. A closed
    pipe on stdout, wherever it is found (a --help written into `head`), ends it with a quiet
    141 (`frame.broken_pipe`)."""
    try:
        return _run_verb(argv)
    except BrokenPipeError:
        from settled.cli.frame import broken_pipe

        return broken_pipe()


def _run_verb(argv: list[str]) -> int:
    from settled.cli.reads import parse_quick

    quick = parse_quick(argv)
    if quick is not None:
        from settled.cli.frame import execute, with_runtime

        return execute(quick, with_runtime)
    from settled.cli.verbs import main as run_verb

    return run_verb(argv)
