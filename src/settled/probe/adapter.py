"""The seam between the checklist and a runtime: the `Adapter` protocol and the one chooser.

An adapter answers every question of `questions.QUESTIONS` by experiment on its runtime, and
says what it drove (name, version, how, where). `open_adapter` turns what `--runtime` names
(`settled`, `subprocess`, `swerex`, or an http(s) URL of a settled service) into one, refusing
anything else as bad input in one line.
Must never: fall back to another runtime than the one named, or import an optional runtime
(swerex) before it is named.
"""

from __future__ import annotations

from typing import Protocol

from settled.errors import BadInput
from settled.probe.host import Sweep
from settled.probe.questions import Experiment

RUNTIMES = ("settled", "subprocess", "swerex")


class Adapter(Protocol):
    name: str

    def describe(self) -> dict[str, str]:
        """`name`, `version`, `how` (what exactly is driven) and `where` it runs."""
        ...

    def experiments(self) -> dict[str, Experiment]:
        """One experiment per question id; each ends every process it starts."""
        ...

    def close(self) -> None:
        """End whatever the adapter holds (a runtime, a home, a connection)."""
        ...


def open_adapter(runtime: str, sweep: Sweep) -> Adapter:
    """The adapter `runtime` names; BadInput (exit 2) for an unknown name, an unreachable
    URL or a runtime not installed here."""
    if runtime == "settled":
        from settled.probe.settled_adapter import SettledAdapter
        from settled.probe.settled_local import LocalBackend

        return SettledAdapter(sweep, LocalBackend())
    if runtime.startswith(("http://", "https://")):
        from settled.probe.settled_adapter import SettledAdapter
        from settled.probe.settled_http import HttpBackend

        return SettledAdapter(sweep, HttpBackend(runtime))
    if runtime == "subprocess":
        from settled.probe.plain import PlainAdapter

        return PlainAdapter(sweep)
    if runtime == "swerex":
        from settled.probe.swe_rex import SwerexAdapter, installed

        if installed() is None:
            raise BadInput(
                "--runtime swerex: SWE-ReX is not installed here (pip install 'settled[swerex]')"
            )
        return SwerexAdapter(sweep)
    raise BadInput(
        f"--runtime {runtime!r} is not one of {', '.join(RUNTIMES)} or an http(s):// URL of a "
        "settled service"
    )
