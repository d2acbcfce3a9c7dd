"""The layers of docs/ARCHITECTURE.md, checked against the imports of src/settled.

Every `import settled...` (including those under TYPE_CHECKING and inside functions: a loop
hidden from the interpreter is still a loop for a reader) must point down or sideways into a
unit its own unit may use. A failure names the file, the line, both modules and the rule, so the
picture in ARCHITECTURE.md and the code cannot drift apart silently.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

# Modules every layer may import: pure, no I/O policy, no process work.
FOUNDATION = {
    "settled",
    "settled.atomic",
    "settled.backends",
    "settled.canonical",
    "settled.daemons",
    "settled.environment",
    "settled.errors",
    "settled.exitcodes",
    "settled.faults",
    "settled.grammar",
    "settled.grants",
    "settled.home",
    "settled.identity",
    "settled.helper_process",
    "settled.localdb",
    "settled.netledger",
    "settled.netpolicy",
    "settled.peers",
    "settled.printable",
    "settled.nothreads",
    "settled.oomguard",
    "settled.rawthread",
    "settled.receipts",
    "settled.records",
    "settled.render",
    "settled.requests",
    "settled.sockdiag",
    "settled.states",
    "settled.storepass",  # the store's password: found when connecting, never in the home
    "settled.where",
}
# What a face may import besides the Runtime and other faces: types and words, no paths.
FACE_NEUTRAL = {
    "settled",  # the package: its docstring and __version__
    "settled.canonical",
    "settled.environment",  # the caller's variables and env files, resolved where they are
    "settled.errors",
    "settled.exitcodes",
    "settled.faults",  # a face's own named fault points (the server's): a name and a crash
    "settled.grammar",
    "settled.identity",
    "settled.netpolicy",  # --allow-host's grammar, checked where a body or flag arrives
    "settled.peers",  # a server judges its TCP peers as the launcher and the journal do theirs
    "settled.oomguard",  # a server's own oom_score_adj: one write to /proc/self
    "settled.printable",  # the one escape of what a command controls, in every human view
    "settled.records",
    "settled.render",
    "settled.requests",  # one request type per verb: what a face asks, in its grammar
    "settled.states",
    "settled.where",  # the CLI's thin client finds its home's warm process without a Runtime
}
FACES = {
    "settled.cli",
    "settled.cli.verbs",
    "settled.cli.parser",
    "settled.cli.running",
    "settled.cli.frame",
    "settled.cli.reads",
    "settled.cli.notices",
    "settled.cli.closing",
    "settled.cli.thin",
    "settled.cli.worker",
    "settled.cli.__main__",
    "settled.client",
    "settled.demo",
    "settled.mcp_server",
    "settled.relay",
    "settled.__main__",
}

# (unit, module prefix), most specific first.
UNITS: list[tuple[str, str]] = [
    ("journal-wire", "settled.workspace.journal.wire"),
    ("proxy-wire", "settled.netproxy.wire"),
    ("proxy", "settled.netproxy"),
    ("journal", "settled.workspace.journal"),
    ("store-sqlite", "settled.store.sqlite"),
    ("store", "settled.store"),
    ("decisions", "settled.close.decide"),
    ("decisions", "settled.close.deadline"),  # the close's one deadline, across resumes
    ("decisions", "settled.status"),
    ("decisions", "settled.clocks"),  # the four clocks of /ui, over the close's facts
    ("decisions", "settled.recovery_decide"),  # recovery's verdicts, over what it observed
    ("close", "settled.close.join"),
    ("close", "settled.close.facts"),  # reads the store for the join and for explain
    ("decisions", "settled.close"),  # the package: a docstring
    ("boundary", "settled.boundary"),
    ("log", "settled.log"),
    ("objects", "settled.objects"),
    ("workspace", "settled.workspace"),
    ("owner", "settled.owner"),
    ("sessions", "settled.sessions"),
    ("recovery", "settled.recovery"),
    ("runtime", "settled.runtime"),
    ("faces", "settled.server"),
    ("faces", "settled.integrations"),  # the harness adapters: through the Runtime or Client
    ("faces", "settled.probe"),  # `settled probe`: experiments through the Runtime or Client
    ("faces", "settled.soak"),  # the crash soak: drives the Runtime, the CLI and the server
]

BELOW_RUNTIME = {
    "foundation",
    "decisions",
    "store",
    "store-sqlite",
    "boundary",
    "log",
    "journal-wire",
    "journal",
    "proxy-wire",
    "proxy",
    "workspace",
    "objects",
    "owner",
    "sessions",
    "close",
    "recovery",
}
# unit -> the units it may import (its own included where listed).
ALLOWED: dict[str, set[str]] = {
    "foundation": {"foundation"},
    "decisions": {"foundation", "decisions"},
    "store": {"foundation", "store", "store-sqlite"},  # open_store is the one chooser
    "store-sqlite": {"foundation", "store"},
    "boundary": {"foundation", "boundary"},
    "log": {"foundation", "log", "objects"},  # a settled stream is sealed into objects
    "objects": {"foundation", "objects"},
    "journal-wire": set(),  # standard library only: the owner imports it under -I -S
    "journal": {"foundation", "journal", "journal-wire"},
    "proxy-wire": set(),  # standard library only: the owner seals its ledger under -I -S
    "proxy": {"foundation", "proxy", "proxy-wire", "boundary"},  # a task's namespace: podhost
    "workspace": {"foundation", "workspace", "objects", "journal", "journal-wire", "store"},
    "owner": {
        "foundation",
        "owner",
        "boundary",
        "log",
        "objects",
        "store",
        "journal",
        "journal-wire",
        "proxy",
        "proxy-wire",
    },
    "sessions": {"foundation", "decisions", "store"},
    "close": {"foundation", "decisions", "store", "close"},
    "recovery": {
        "foundation",
        "decisions",
        "store",
        "boundary",
        "log",
        "objects",
        "owner",
        "journal-wire",
        "proxy",
        "sessions",
    },
    "runtime": BELOW_RUNTIME | {"runtime"},
    "faces": {"face-neutral", "runtime", "faces"},
}
WHY = {
    "decisions": "a decision takes facts (records), never a component",
    "store": "the store decides state and touches nothing else",
    "store-sqlite": "an implementation sees only its protocol and the foundation",
    "boundary": "the boundary is the bottom of process work",
    "log": "logs are bytes with cursors and know nothing of sessions",
    "objects": "the object store knows content and names, nothing of manifests or sessions",
    "journal-wire": "the journal's wire protocol imports only the standard library",
    "proxy-wire": "the proxy's wire protocol imports only the standard library",
    "proxy": "the proxy judges and relays; it reaches a task's namespace through boundary",
    "workspace": "the workspace service uses the Store protocol, not an implementation",
    "owner": "the owner uses boundaries, logs, the journal and the Store protocol",
    "sessions": "liveness is injected; sessions never touch a process",
    "close": "the close join gets its store, workspace and sessions in its constructor",
    "recovery": "recovery gets its store, sessions and sandbox in its constructor",
    "runtime": "the Runtime composes everything below it and no face",
    "faces": "a face talks to the Runtime only",
}


# An implementation behind a seam is named by the one module that chooses it, and by no caller:
# a second implementation is then a new module and an edit of the chooser only.
CHOSEN_ONLY_BY: dict[str, set[str]] = {
    "settled.store.sqlite": {"settled.store"},
    "settled.store.postgres": {"settled.store"},
    "settled.objects.local": {"settled.objects"},
    "settled.objects.s3": {"settled.objects"},
    "settled.owner.zygote": {"settled.runtime.composition"},
    "settled.owner.home_launcher": {"settled.runtime.composition"},
    "settled.owner.liveness": {"settled.runtime.composition"},
    "settled.boundary.local": {"settled.boundary.sandbox"},
    "settled.boundary.command": {"settled.boundary.sandbox"},
}


def unit_of(module: str) -> str:
    if module in FACES:
        return "faces"
    if module in FOUNDATION:
        return "foundation"
    for unit, prefix in UNITS:
        if module == prefix or module.startswith(prefix + "."):
            return unit
    raise AssertionError(f"{module} is in no unit of tests/test_layers.py: add it to one")


def allowed(importer: str, target: str) -> bool:
    if target in CHOSEN_ONLY_BY and importer not in CHOSEN_ONLY_BY[target] | {target}:
        return False
    unit, wanted = unit_of(importer), unit_of(target)
    if unit == "faces":
        # the Runtime through its facade (runtime/__init__.py), never one of its parts
        return target in FACE_NEUTRAL or target == "settled.runtime" or wanted == "faces"
    return wanted in ALLOWED[unit]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def settled_imports(path: Path, module: str) -> Iterator[tuple[int, str]]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:  # `from settled.x import y`: y may be a module itself
                yield node.lineno, _submodule(f"{base}.{alias.name}") or base


def _submodule(name: str) -> str | None:
    path = SRC.joinpath(*name.split("."))
    return name if path.with_suffix(".py").is_file() or path.is_dir() else None


def violations() -> Iterator[str]:
    for path in sorted((SRC / "settled").rglob("*.py")):
        importer = module_name(path)
        for line, target in settled_imports(path, importer):
            if target.split(".")[0] != "settled":
                if unit_of(importer) == "journal-wire" and not _stdlib(target):
                    yield f"{path.relative_to(SRC.parent)}:{line}: {importer} imports {target}"
                continue
            if not allowed(importer, target):
                rule = WHY.get(unit_of(importer), "")
                if target in CHOSEN_ONLY_BY:
                    chooser = ", ".join(sorted(CHOSEN_ONLY_BY[target]))
                    rule = f"an implementation behind a seam is chosen by {chooser} only"
                yield (
                    f"{path.relative_to(SRC.parent)}:{line}: {importer} "
                    f"({unit_of(importer)}) imports {target} ({unit_of(target)}): {rule}"
                )


def _stdlib(module: str) -> bool:
    return module.split(".")[0] in sys.stdlib_module_names or module == "__future__"


def test_every_import_points_down_or_through_the_runtime() -> None:
    found = list(violations())
    assert not found, "imports against docs/ARCHITECTURE.md:\n" + "\n".join(found)


def test_every_module_is_in_a_unit() -> None:
    for path in (SRC / "settled").rglob("*.py"):
        unit_of(module_name(path))


@pytest.mark.parametrize(
    ("importer", "target", "ok"),
    [
        ("settled.server.views", "settled.log.reader", False),  # a face skipping the Runtime
        ("settled.server.views", "settled.runtime", True),
        ("settled.server.views", "settled.runtime.admission", False),  # a part, not the facade
        ("settled.close.join", "settled.runtime", False),  # an arrow pointing up
        ("settled.status", "settled.store", False),  # a decision reading a component
        ("settled.workspace.checkpoint", "settled.store.sqlite", False),  # past the protocol
        ("settled.workspace.checkpoint", "settled.store", True),
        ("settled.owner.main", "settled.workspace.journal.wire", True),
        ("settled.recovery", "settled.boundary.local", False),  # the sandbox is injected
        ("settled.recovery", "settled.recovery_decide", True),  # its verdicts, pure
        ("settled.recovery_decide", "settled.sessions", False),  # a decision asking a service
        ("settled.store", "settled.store.sqlite", True),  # the one chooser
        ("settled.workspace.checkpoint", "settled.objects.local", False),  # past the seam
        ("settled.objects", "settled.objects.s3", True),  # the object store's one chooser
        ("settled.objects", "settled.workspace.manifest", False),  # objects know no manifests
    ],
)
def test_the_rules_catch_what_they_are_for(importer: str, target: str, ok: bool) -> None:
    assert allowed(importer, target) is ok


# The Runtime and the services decide and ask; only owner/ and boundary/ touch processes.
ASKERS = ["settled/runtime", "settled/sessions.py", "settled/recovery.py", "settled/status.py"]
ASKERS += ["settled/recovery_decide.py"]
ASKERS += [f"settled/{d}" for d in ("close", "store")]
PROCESS_CALLS = {"kill", "killpg", "pidfd_open", "waitpid", "pidfd_send_signal"}
PROCESS_MODULES = {"signal", "select"}


def _asker_files() -> Iterator[Path]:
    for name in ASKERS:
        path = SRC / name
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def test_process_work_stays_in_the_owner_and_the_boundary() -> None:
    found = []
    for path in _asker_files():
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Attribute) and node.attr in PROCESS_CALLS:
                names = [f"os.{node.attr}"]
            elif isinstance(node, ast.Constant) and str(node.value).startswith("/proc/"):
                names = [f"a path {node.value!r}"]  # an f-string's first part included
            else:
                continue
            for name in names:
                if name in PROCESS_MODULES or name.startswith(("os.", "a path")):
                    found.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: {name}")
    assert not found, "process work outside owner/ and boundary/:\n" + "\n".join(found)


def test_one_live_predicate() -> None:
    """`states.is_live` / `SessionRecord.live` is the only "is it still its owner's" test."""
    found = [
        f"{path.relative_to(SRC.parent)}:{number}"
        for path in sorted((SRC / "settled").rglob("*.py"))
        if path.name != "states.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "LIVE_STATES" in line
    ]
    assert not found, "use SessionRecord.live or states.is_live instead:\n" + "\n".join(found)


# The Python HTTP client is installed and imported on its own (a caller's machine): beside httpx
# and anyio it takes from settled only the error classes a Runtime caller catches, the caller's
# environment policy and the run verb's exit-code rule (docs/ARCHITECTURE.md, faces).
CLIENT_IMPORTS = {"settled.errors", "settled.environment", "settled.exitcodes", "settled.requests"}


def test_the_client_imports_of_settled_only_errors_environment_and_exit_codes() -> None:
    path = SRC / "settled" / "client.py"
    found = {t for _, t in settled_imports(path, "settled.client") if t.startswith("settled")}
    assert found == CLIENT_IMPORTS, sorted(found)


def test_the_runtime_reaches_the_workspace_through_its_service() -> None:
    """`workspace/service.py`'s WorkspaceService is the seam ARCHITECTURE.md draws: the
    Runtime imports no other module of the workspace layer (nor the object store's)."""
    found = [
        f"{path.relative_to(SRC.parent)}:{line}: {target}"
        for path in sorted((SRC / "settled" / "runtime").rglob("*.py"))
        for line, target in settled_imports(path, module_name(path))
        if target.startswith("settled.workspace") and target != "settled.workspace.service"
    ]
    assert not found, "the Runtime past its workspace service:\n" + "\n".join(found)
