"""The front door: the README's first commands after `scripts/demo` work as written, in a real
shell, with `settled` found the way the README says (`.venv-demo/bin` on PATH)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
INSTALLED = Path(sys.executable).parent / "settled"  # the console script of this environment


def _own_commands_block() -> str:
    text = README.read_text()
    start = text.index("Then, for your own commands")
    block = re.search(r"```sh\n(.*?)```", text[start:], re.S)
    assert block is not None, "the README's own-commands block is gone"
    return block.group(1)


def test_the_readmes_next_commands_run_as_written_after_the_demo(tmp_path: Path) -> None:
    clone = tmp_path / "clone"  # where the user stands: the clone scripts/demo set up
    (clone / ".venv-demo" / "bin").mkdir(parents=True)
    (clone / ".venv-demo" / "bin" / "settled").symlink_to(INSTALLED)
    user_home = tmp_path / "user"
    (user_home / "proj").mkdir(parents=True)
    (user_home / "proj" / "Makefile").write_text("test:\n\t@echo the tests ran > result.txt\n")
    path = ":".join(p for p in os.environ["PATH"].split(":") if not (Path(p) / "settled").exists())
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", _own_commands_block()],
        cwd=clone,
        env={**os.environ, "HOME": str(user_home), "PATH": path,
             "SETTLED_HOME": str(tmp_path / "home")},  # never the machine's own home
        capture_output=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (user_home / "proj" / "result.txt").read_text() == "the tests ran\n"
    assert b"make test" in done.stdout  # ps named the command; close exited 0: complete


def test_scripts_demo_says_how_settled_gets_on_path() -> None:
    script = (README.parent / "scripts" / "demo").read_text()
    block = _own_commands_block()
    assert block.splitlines()[0].startswith('export PATH="$PWD/.venv-demo/bin:$PATH"')
    assert 'export PATH="%s:$PATH"' in script and '"$venv/bin"' in script


MISSING = "import sys; sys.modules[{name!r}] = None; from settled.cli import main; sys.exit(main())"


@pytest.mark.parametrize(
    ("flag", "url", "module", "extra"),
    [
        ("--store", "postgresql://settled@127.0.0.1:1/settled", "psycopg", "postgres"),
        ("--objects", "s3://bucket/prefix", "boto3", "s3"),
    ],
)
def test_a_remote_backend_without_its_extra_says_which_to_install(
    tmp_path: Path, flag: str, url: str, module: str, extra: str
) -> None:
    """The package's import fails as it does where it was never installed (None in
    sys.modules is how the import system refuses a module); the CLI's own process, no
    warm launcher between."""
    (tmp_path / "ws").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", MISSING.format(name=module), flag, url,
         "task", "new", "--workspace", str(tmp_path / "ws")],
        env={**os.environ, "SETTLED_HOME": str(tmp_path / "home"), "SETTLED_CLI": "local",
             "AWS_ENDPOINT_URL": "http://127.0.0.1:1"},
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.decode().splitlines() == [
        f"settled: BadBackend: {url} needs the {extra} extra ({module} is not installed): "
        f"pip install 'settled[{extra}]'"
    ]
