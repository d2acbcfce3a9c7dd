"""`/ui` of `settled serve`, in a real headless Chromium against a real server process.

The browser is Debian's Chromium (`apt-get install chromium`), started by this file with the
flags a machine without a network needs and a fresh `--user-data-dir`, and driven by Playwright
over the DevTools protocol (`connect_over_cdp`: no browser is downloaded). Without Chromium the
browser tests skip with the reason, except on CI (`CI=true`), where they fail.

The page is checked the way a person would use it: it asks for the token, shows the task, starts
a session, shows its process clock settle with the receipt's digest, closes the task and shows
the close receipt. A hostile command's output (markup, script, ANSI escapes, invalid UTF-8, a
4 MiB line) must appear as text and never run; a scoped token must see only its task. The live
stream (`GET /v1/events`) is also checked over plain HTTP: snapshot, resume by Last-Event-ID,
and event ids that count only what the token may see.

Every server and browser a test starts is ended by its pid (SIGTERM, then SIGKILL, bounded), its
sessions are settled, and conftest kills anything still carrying the test's marker.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from test_server import settle_all

from settled.runtime import Runtime

if TYPE_CHECKING:
    from playwright.sync_api import Page

TOKEN = "ui-test-token-full-access-0123456789"
SCOPED = "ui-test-token-scoped-abcdefghijklmn"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)
START_S = 30.0
WAIT_MS = 60_000


# -- a server and a browser, each ended by its pid ----------------------------------------------


def _end(process: subprocess.Popen[bytes], group: bool = False) -> None:
    """SIGTERM (its whole process group if it leads one), then SIGKILL; bounded."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(process.pid, signal.SIGTERM)
            else:
                process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL) if group else process.kill()
            process.wait(timeout=10)
    if group:  # the renderers and the zygote are in the browser's group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


class Server:
    """`settled serve --port 0` as a subprocess; the URL is read from its stderr."""

    def __init__(self, home: Path, log: Path, tokens: Path | None) -> None:
        self.home, self.log = home, log
        argv = [sys.executable, "-m", "settled", "serve", "--home", str(home), "--port", "0"]
        if tokens is not None:
            argv += ["--tokens", str(tokens)]
        with open(log, "wb") as sink:
            self.process = subprocess.Popen(
                argv,
                env={**os.environ, "SETTLED_TOKEN": TOKEN},
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=sink,
            )
        self.url = self._listening()

    def _listening(self) -> str:
        give_up = time.monotonic() + START_S
        while time.monotonic() < give_up:
            for line in self.log.read_text(errors="replace").splitlines():
                if "listening on http://" in line:
                    return line.split("listening on ")[1].split()[0]
            if self.process.poll() is not None:
                raise AssertionError(f"serve exited {self.process.returncode}: {self.text()}")
            time.sleep(0.05)
        raise AssertionError(f"serve did not listen in {START_S} s: {self.text()}")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def client(self, token: str = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60.0)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def start_server(tmp_path: Path, home: Path) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def start(tokens: Path | None = None) -> Server:
        server = Server(home, tmp_path / f"serve-{len(started)}.log", tokens)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            _end(server.process)
        settle_all(home)


def _browser_missing() -> str | None:
    if not os.access(CHROMIUM, os.X_OK):
        return f"{CHROMIUM} is not installed (apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[dev]')"
    return None


def _need_browser() -> None:
    missing = _browser_missing()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser tests, but {missing}")
        pytest.skip(missing)


@pytest.fixture
def browser_page(tmp_path: Path) -> Iterator[Page]:
    """A page of a fresh headless Chromium; every dialog it opens is recorded in
    ``page.dialogs`` (and dismissed), so a test can assert none was."""
    _need_browser()
    from playwright.sync_api import sync_playwright

    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    argv = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}"]
    argv += ["--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", "about:blank"]
    # Chromium makes its singleton socket's directory in TMPDIR: one of the test's own, short
    # enough for a socket path, removed once the browser has ended
    scratch = tempfile.mkdtemp(prefix="settled-ui-")
    try:
        with open(tmp_path / "chromium.log", "wb") as sink:  # the child keeps its own copy
            chromium = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=sink,
                env={**os.environ, "TMPDIR": scratch},
                start_new_session=True,  # its renderers share its process group: ended with it
            )
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    try:
        port = _devtools_port(profile / "DevToolsActivePort", chromium)
        with sync_playwright() as driver:
            browser = driver.chromium.connect_over_cdp(f"http://127.0.0.1:{port}", timeout=30_000)
            page = browser.contexts[0].new_page()
            page.set_default_timeout(WAIT_MS)
            dialogs: list[str] = []
            page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
            page.dialogs = dialogs  # type: ignore[attr-defined]
            try:
                yield page
            finally:
                browser.close()
    finally:
        _end(chromium, group=True)
        shutil.rmtree(scratch, ignore_errors=True)
        assert chromium.poll() is not None


def _devtools_port(path: Path, chromium: subprocess.Popen[bytes]) -> int:
    give_up = time.monotonic() + START_S
    while time.monotonic() < give_up:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int(path.read_text().split()[0])
        if chromium.poll() is not None:
            raise AssertionError(f"chromium exited {chromium.returncode} before it listened")
        time.sleep(0.05)
    raise AssertionError(f"chromium opened no DevTools port in {START_S} s")


# -- helpers ----------------------------------------------------------------------------------


def _task(client: httpx.Client, workspace: Path) -> str:
    workspace.mkdir(parents=True, exist_ok=True)
    answer = client.post("/v1/tasks", json={"workspace": str(workspace)})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["task"])


def _two_tasks(home: Path, tmp_path: Path) -> tuple[str, str]:
    made = []
    with Runtime(str(home)) as rt:
        for name in ("mine", "other"):
            (tmp_path / name).mkdir()
            made.append(rt.new_task(str(tmp_path / name)).task)
    return made[0], made[1]


def _run(client: httpx.Client, task: str, key: str, shell: str) -> str:
    answer = client.post(f"/v1/tasks/{task}/sessions", json={"key": key, "shell": shell})
    assert answer.status_code == 201, answer.text
    session = str(answer.json()["session"])
    settled = client.get(f"/v1/sessions/{session}", params={"wait": 60})
    assert settled.status_code == 200 and settled.json()["state"] == "settled", settled.text
    return session


def _events(answer: httpx.Response) -> list[dict[str, Any]]:
    """The SSE frames of a finished response: [{event, id, data}]."""
    frames = []
    for block in answer.text.split("\n\n"):
        fields: dict[str, Any] = {}
        for line in block.splitlines():
            if line and not line.startswith(":"):
                name, _, value = line.partition(": ")
                fields[name] = value
        if "data" in fields:
            fields["data"] = json.loads(fields["data"])
            frames.append(fields)
    return frames


def _open_task(page: Page, url: str, task: str, token: str | None = None) -> None:
    page.goto(f"{url}/ui" + (f"#token={token}" if token else ""))
    page.locator(f"li[data-task='{task}'] button").click()
    page.locator("#task-pane").wait_for(state="visible")


# -- the page in a browser ----------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_the_page_shows_a_session_settle_and_the_close_receipt_appear(
    start_server: Callable[..., Server], browser_page: Page, tmp_path: Path
) -> None:
    server = start_server()
    page = browser_page
    with server.client() as client:
        task = _task(client, tmp_path / "workspace")
        page.goto(f"{server.url}/ui")
        page.locator("#token-form").wait_for(state="visible")  # the page holds nothing: it asks
        page.fill("#token-input", TOKEN)
        page.click("#token-use")
        page.locator("#link[data-state='live']").wait_for()
        assert page.evaluate("sessionStorage.getItem('settled.token')") == TOKEN
        assert TOKEN not in page.url
        page.locator(f"li[data-task='{task}'] button").click()

        page.fill("#start-command", "echo started from the page > proof.txt; sleep 0.3")
        page.click("#start button[type=submit]")
        row = page.locator("#session-rows tr").first
        row.wait_for()
        session = row.get_attribute("data-session")
        assert session is not None and session.startswith("s_")
        process = row.locator("td[data-clock='process'][data-state='settled']")
        process.wait_for()
        receipt = client.get(f"/v1/sessions/{session}", params={"wait": 60}).json()["receipt"]
        assert process.get_attribute("data-digest") == receipt["digest"]
        assert row.locator("td[data-clock='transport']").get_attribute("data-state") == "settled"
        assert row.locator("td[data-clock='workspace']").get_attribute("data-state") == "not_yet"
        # what left the sandbox through the proxy (its default network), from the ledger
        assert receipt["network"]["ledger"]["summary"] == "no connection"
        row.locator(".network", has_text="network: no connection").wait_for()

        page.click("#close button[type=submit]")
        shown = page.locator("#close-receipt:not([hidden])")
        shown.wait_for()
        close = client.post(f"/v1/tasks/{task}/close", json={}).json()  # the same receipt again
        assert shown.get_attribute("data-digest") == close["digest"]
        assert close["digest"] in page.text_content("#close-receipt")
        assert f"{session} (process receipt" in page.text_content("#close-receipt")
        assert "network: no connection" in page.text_content("#close-receipt")
        workspace = page.locator(
            f"tr[data-session='{session}'] td[data-clock='workspace'][data-state='settled']"
        )
        workspace.wait_for()
        assert workspace.get_attribute("data-digest") == close["checkpoint"]["digest"]
        page.locator(f"li[data-task='{task}'] .badge[data-state='complete']").wait_for()
        page.locator("#explain-brief", has_text=f"task {task} is COMPLETE").wait_for()
    assert page.dialogs == []  # type: ignore[attr-defined]


def _in_view(page: Page, selector: str) -> bool:
    """Whether the element's whole box is inside the window (the assertion a person makes)."""
    return bool(
        page.evaluate(
            """(selector) => {
                const box = document.querySelector(selector).getBoundingClientRect();
                return box.height > 0 && box.top >= 0 && box.left >= 0
                    && box.bottom <= window.innerHeight && box.right <= window.innerWidth;
            }""",
            selector,
        )
    )


def _start(client: httpx.Client, task: str, key: str, shell: str) -> str:
    answer = client.post(f"/v1/tasks/{task}/sessions", json={"key": key, "shell": shell})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["session"])


@pytest.mark.timeout(240)
def test_a_task_has_an_address_a_hint_until_one_is_chosen_and_its_log_beside_it(
    start_server: Callable[..., Server], browser_page: Page, tmp_path: Path
) -> None:
    server = start_server()
    page = browser_page
    page.set_viewport_size({"width": 1280, "height": 720})
    with server.client() as client:
        target = _task(client, tmp_path / "target")  # the oldest: the bottom of a long list
        others = [_task(client, tmp_path / f"w{n}") for n in range(24)]
        said = _run(client, target, "hello", "echo hello from the target")
        _run(client, target, "fails", "exit 3")
        _run(client, target, "missing", "no-such-command-here")
        running = _start(client, target, "slow", "sleep 60")

        page.goto(f"{server.url}/ui#token={TOKEN}")
        page.locator(f"li[data-task='{target}']").wait_for()
        assert page.locator("#empty-pane").is_visible() and not page.is_visible("#task-pane")
        assert "Select a task" in (page.text_content("#empty-hint") or "")
        assert "token" not in page.url and "#" not in page.url

        page.locator(f"li[data-task='{target}'] button").click()  # scrolled to, far down
        page.wait_for_function(f"location.hash === '#task={target}'")
        assert page.text_content("#task-id") == target and not page.is_visible("#empty-pane")
        assert _in_view(page, "#task-id")

        # the short explain, and the running session shown as running (not unknown)
        brief = page.locator("#explain-brief", has_text="1 of them still running")
        brief.wait_for()
        [line] = [x for x in (brief.text_content() or "").splitlines() if running in x]
        assert (
            line.split()[0] == "running" and "sleep 60" in line and "no death evidence yet" in line
        )
        assert "exit 3" in (brief.text_content() or "") and "no-such-command-here" in (
            brief.text_content() or ""
        )
        assert "cgroup.events" not in (brief.text_content() or "")
        row = page.locator(f"tr[data-session='{running}']")
        assert row.get_attribute("data-state") == "running"
        assert "unknown" not in (row.text_content() or "").lower()
        assert row.locator("td[data-clock='process']").get_attribute("data-state") == "not_yet"

        # the log opens beside the task's sessions, in view
        page.locator(f"tr[data-session='{said}'] button").click()
        page.locator("#log-out[data-final='true']").wait_for()
        assert "hello from the target" in (page.text_content("#log-out") or "")
        page.wait_for_function(
            "document.getElementById('log-pane').getBoundingClientRect().bottom <= innerHeight"
        )
        assert _in_view(page, "#log-pane") and _in_view(page, f"tr[data-session='{said}']")

        # selecting another task puts it in the address; Back and a reload follow the address
        page.locator(f"li[data-task='{others[0]}'] button").click()
        page.wait_for_function(f"location.hash === '#task={others[0]}'")
        assert page.text_content("#task-id") == others[0] and not page.is_visible("#log-pane")
        page.go_back()
        page.locator("#task-id", has_text=target).wait_for()
        page.reload()
        page.locator("#task-id", has_text=target).wait_for()
        assert page.url.endswith(f"/ui#task={target}")
        page.goto(f"{server.url}/ui#task={others[3]}")
        page.locator("#task-id", has_text=others[3]).wait_for()
        page.goto(f"{server.url}/ui#task=t_00000000000000ff")
        page.locator("#empty-hint", has_text="not among the tasks this token can see").wait_for()
        page.goto(f"{server.url}/ui#task=<b>x</b>")  # not an id: ignored, never shown as markup
        page.locator("#empty-pane").wait_for()
        assert page.locator("#empty-pane b").count() == 0
        client.post(f"/v1/sessions/{running}/signal", json={"signal": "KILL"})
    assert page.dialogs == []  # type: ignore[attr-defined]


HOSTILE = (
    "printf '<img src=x onerror=alert(1)></script><script>alert(2)</script>\\n'; "
    "printf '\\033[31mred\\033[0m \\377\\376 \\342\\200\\256evil\\n'; "
    "printf '<b>bold</b>' >&2"
)


@pytest.mark.timeout(240)
def test_hostile_output_appears_as_text_and_never_runs(
    start_server: Callable[..., Server], browser_page: Page, tmp_path: Path
) -> None:
    server = start_server()
    page = browser_page
    with server.client() as client:
        task = _task(client, tmp_path / "workspace")
        hostile = _run(client, task, "hostile", HOSTILE)
        line = _run(client, task, "line", "head -c 4194304 /dev/zero | tr '\\0' x")
        split = _run(
            client, task, "split", "head -c 65535 /dev/zero | tr '\\0' a; printf '\\303\\251 end'"
        )
    _open_task(page, server.url, task, TOKEN)
    assert "token" not in page.url  # the fragment left the address bar
    page.locator(f"tr[data-session='{hostile}'] button").click()
    page.locator("#log-out[data-final='true']").wait_for()
    text = page.text_content("#log-out") or ""
    assert "<img src=x onerror=alert(1)></script><script>alert(2)</script>" in text
    assert "\\x1b[31mred\\x1b[0m \\xff\\xfe \\u202eevil" in text  # escapes, never rendered
    assert "<b>bold</b>" in text
    command = page.text_content(f"tr[data-session='{hostile}'] td.command") or ""
    assert "<img src=x onerror=alert(1)>" in command
    counts = page.evaluate(
        "[document.querySelectorAll('img').length, document.scripts.length,"
        " document.querySelectorAll('#log-out b, #log-out script').length]"
    )
    assert counts == [0, 1, 0]  # the one script is /ui/app.js

    # A 4 MiB line: read a page at a time, and only the last 16 pages stay in the document.
    page.locator(f"tr[data-session='{line}'] button").click()
    page.locator("#log-out[data-cursor='65536']").wait_for()
    assert page.evaluate("document.getElementById('log-out').textContent.length") == 65536
    page.click("#log-next")
    page.locator("#log-out[data-cursor='131072']").wait_for()
    page.check("#log-follow")
    page.locator("#log-out[data-cursor='4194304'][data-final='true']").wait_for()
    shown = page.evaluate("document.getElementById('log-out').textContent")
    assert shown == "x" * (16 * 65536)
    assert "no longer shown" in (page.text_content("#log-note") or "")
    page.select_option("#log-view", "hex")
    page.fill("#log-from", "4194288")
    page.click("#log-load")
    page.locator("#log-out[data-cursor='4194304']").wait_for()
    assert "4194288  78 78 78" in (page.text_content("#log-out") or "")

    # A character cut by the end of a page is held back and shown whole with the next one.
    page.select_option("#log-view", "text")
    page.locator(f"tr[data-session='{split}'] button").click()
    page.locator("#log-out[data-cursor='65536']").wait_for()
    assert page.text_content("#log-out") == "a" * 65535
    page.click("#log-next")
    page.locator("#log-out[data-final='true'][data-cursor='65541']").wait_for()
    assert page.text_content("#log-out") == "a" * 65535 + "\u00e9 end"
    assert page.dialogs == []  # type: ignore[attr-defined]


@pytest.mark.timeout(180)
def test_a_scoped_token_sees_only_its_task_on_the_page(
    start_server: Callable[..., Server], browser_page: Page, tmp_path: Path, home: Path
) -> None:
    mine, other = _two_tasks(home, tmp_path)
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [{"token": SCOPED, "tasks": [mine]}]}))
    server = start_server(tokens)
    with server.client() as client:
        _run(client, other, "secret", "echo the other task's secret")
        seen = _run(client, mine, "visible", "echo mine")
    page = browser_page
    _open_task(page, server.url, mine, SCOPED)
    settled = f"tr[data-session='{seen}'] td[data-clock='process'][data-state='settled']"
    page.locator(settled).wait_for()
    page.fill("#new-task-workspace", str(tmp_path / "third"))
    page.click("#new-task button")
    page.locator("#tasks-note", has_text="NotPermitted").wait_for()
    assert other not in page.content()
    assert page.locator("li[data-task]").count() == 1
    page.goto(f"{server.url}/ui#token=not-a-token-of-this-server")
    page.locator("#link[data-state='token']").wait_for()
    assert page.locator("#token-form").is_visible()


# -- the live stream over HTTP --------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_the_page_is_served_without_a_token_and_runs_no_inline_script(
    start_server: Callable[..., Server],
) -> None:
    server = start_server()
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        for path, media in (("/ui", "text/html"), ("/ui/app.js", "text/javascript")):
            answer = anonymous.get(path)
            assert answer.status_code == 200 and answer.headers["content-type"].startswith(media)
            policy = answer.headers["content-security-policy"]
            assert "script-src 'self';" in policy and "img-src 'none'" in policy
            assert "unsafe" not in policy
        assert anonymous.get("/ui/").status_code in (307, 308)
        for path in ("/v1/events", "/v1/tasks/t_0000000000000000/clocks"):
            assert anonymous.get(path).status_code == 401
        # The script it serves writes what the server sends as text only (its comments aside).
        served = anonymous.get("/ui/app.js").text.splitlines()
    code = "\n".join(line for line in served if not line.lstrip().startswith("//"))
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in code, sink


@pytest.mark.timeout(120)
def test_the_event_stream_resumes_from_its_last_event_id(
    start_server: Callable[..., Server], tmp_path: Path
) -> None:
    server = start_server()
    with server.client() as client:
        task = _task(client, tmp_path / "workspace")
        [snapshot] = _events(client.get("/v1/events"))
        assert snapshot["event"] == "snapshot" and snapshot["data"]["reset"] == "first"
        assert snapshot["data"]["order"] == [task]
        assert snapshot["data"]["tasks"][0]["sessions"] == []
        session = _run(client, task, "k", "echo one")

        [change] = _events(client.get("/v1/events", headers={"Last-Event-ID": snapshot["id"]}))
        assert change["event"] == "tasks" and change["id"] != snapshot["id"]
        [view] = change["data"]["tasks"]
        [row] = view["sessions"]
        assert row["session"] == session and row["clocks"]["process"]["state"] == "settled"

        [quiet] = _events(client.get("/v1/events", headers={"Last-Event-ID": change["id"]}))
        assert quiet == {"event": "tasks", "id": change["id"], "data": {"tasks": []}}

        instance = snapshot["id"].split("-")[0]
        other = "0" * 8 if instance != "0" * 8 else "1" * 8
        [reset] = _events(client.get("/v1/events", headers={"Last-Event-ID": f"{other}-1"}))
        assert reset["event"] == "snapshot" and reset["data"]["reset"] == "restarted"
        bad = client.get("/v1/events", headers={"Last-Event-ID": "<script>"})
        assert bad.status_code == 400 and "Last-Event-ID" in bad.json()["message"]

        with client.stream("GET", "/v1/events", params={"follow": "1"}) as live:
            lines = live.iter_lines()
            assert next(lines) == "event: snapshot"
            second = _run(client, task, "k2", "echo two")
            for line in lines:  # bounded by the client's read timeout and the test's
                if line.startswith("data: ") and second in line:
                    break


@pytest.mark.timeout(120)
def test_a_scoped_tokens_event_ids_count_only_its_own_tasks(
    start_server: Callable[..., Server], tmp_path: Path, home: Path
) -> None:
    mine, other = _two_tasks(home, tmp_path)
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [{"token": SCOPED, "tasks": [mine]}]}))
    server = start_server(tokens)
    with server.client(SCOPED) as scoped, server.client() as full:
        [snapshot] = _events(scoped.get("/v1/events"))
        assert snapshot["data"]["order"] == [mine]
        assert [t["task"] for t in snapshot["data"]["tasks"]] == [mine]
        _run(full, other, "elsewhere", "echo not yours")
        [full_view] = _events(full.get("/v1/events"))
        assert set(full_view["data"]["order"]) == {mine, other}
        since = scoped.get("/v1/events", headers={"Last-Event-ID": snapshot["id"]})
        assert _events(since) == [{"event": "tasks", "id": snapshot["id"], "data": {"tasks": []}}]
        assert scoped.get(f"/v1/tasks/{other}/clocks").status_code == 404
        assert scoped.get(f"/v1/tasks/{mine}/clocks").json()["task"] == mine


@pytest.mark.timeout(180)
@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_a_change_made_outside_the_server_reaches_a_follower(
    start_server: Callable[..., Server],
    tmp_path: Path,
    home: Path,
    store: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No nudge from the server's own handlers here: a Runtime of the test's process writes,
    and the follower hears of it from the store (NOTIFY on PostgreSQL, polling on SQLite)."""
    if store == "postgresql":
        import pg

        request.getfixturevalue("pg_cluster")
        monkeypatch.setenv("SETTLED_STORE", pg.url_for_directory(str(home)))
    server = start_server()
    with server.client() as client, client.stream("GET", "/v1/events?follow=1") as live:
        lines = live.iter_lines()
        assert next(lines) == "event: snapshot"
        snapshot = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        woken = "store notifications and polling" if store == "postgresql" else "polling the store"
        assert snapshot["woken_by"] == woken
        (tmp_path / "workspace").mkdir()
        with Runtime(str(home)) as rt:
            task = rt.new_task(str(tmp_path / "workspace")).task
            session = rt.exec(task, shell="echo from elsewhere", key="elsewhere").session
            rt.wait(session, timeout=60)
        for line in lines:  # bounded by the client's read timeout and the test's
            if line.startswith("data: ") and session in line:
                [view] = [t for t in json.loads(line[6:])["tasks"] if t["task"] == task]
                if view["sessions"][0]["clocks"]["process"]["state"] == "settled":
                    break
    with Runtime(str(home)) as rt:
        rt.close_task(task)  # ends the task's journal watch on whichever store


def _pidfds(pid: int) -> int:
    """The server's pidfds now: an fd closed between the listing and its readlink is none."""
    fds = Path(f"/proc/{pid}/fd")
    return sum(1 for fd in fds.iterdir() if _link(fd) == "anon_inode:[pidfd]")


def _link(fd: Path) -> str | None:
    try:
        return os.readlink(fd)
    except FileNotFoundError:
        return None


@pytest.mark.timeout(120)
def test_the_live_view_closes_every_owner_exit_handle_it_watched(
    start_server: Callable[..., Server], tmp_path: Path
) -> None:
    """A follower makes the view watch each live session's owner for its exit (to show the
    settle at once); once the sessions settle, the server holds none of those handles."""
    server = start_server()
    with server.client() as client:
        task = _task(client, tmp_path / "workspace")
        with client.stream("GET", "/v1/events?follow=1") as live:
            lines = live.iter_lines()
            assert next(lines) == "event: snapshot"
            before = _pidfds(server.process.pid)
            sessions = [_run(client, task, f"k{n}", "sleep 0.2") for n in range(5)]
            settled: set[str] = set()
            for line in lines:
                if line.startswith("data: "):
                    for view in json.loads(line[6:])["tasks"]:
                        settled |= {
                            row["session"]
                            for row in view["sessions"]
                            if row["clocks"]["process"]["state"] == "settled"
                        }
                if settled >= set(sessions):
                    break
            give_up = time.monotonic() + 30  # the handles close at the view's next refresh
            while _pidfds(server.process.pid) > before and time.monotonic() < give_up:
                time.sleep(0.05)
            assert _pidfds(server.process.pid) <= before
