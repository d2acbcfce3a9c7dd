"""SWE-ReX's read_file, write_file and upload for `settled serve --swerex`, inside the task.

Owns: doing a SWE-ReX file call as a command of the runtime's task (the scripts and their
answers are settled.integrations.fileops's, shared with the Inspect sandbox), so a file call
reaches exactly what the task's commands reach: a path means what it means to them (``/root/x``
is the task's own HOME), and a symlink a command left is followed inside the task's view, never
on the host as the server's user. Each call is a keyed settled session of the task:
``swerex:file-read:<n>``, ``swerex:file-write:<n>``, ``swerex:upload:<n>``, n handed out by
X-Request-ID, so a retried call runs once. Sizes: a read comes back whole up to the answer's
cap (SETTLED_SWEREX_OUTPUT_CAP) or is refused, never cut; a write or upload is at most
MAX_FILE_BYTES (a zipped directory: that many bytes unzipped too), else refused.

Must never: open, stat or resolve a path of the request on the host; answer part of a file as
if it were the whole; run one request's file operation twice.
"""

from __future__ import annotations

import io
import zipfile
from typing import TYPE_CHECKING, Any

from settled.integrations import fileops
from settled.integrations._steps import run_step
from settled.server.swerex_service import swerex_error

if TYPE_CHECKING:
    from settled.server.swerex_service import SwerexService

MAX_FILE_BYTES = 1 << 30  # a write's or an upload's bytes: held in memory and kept as stdin
FILE_OP_TIMEOUT_S = 600.0  # a file operation (a FIFO read blocks) is ended after this
Body = dict[str, Any]


def read_file(service: SwerexService, body: Body, request_id: str | None) -> Body:
    """As SWE-ReX's Path.read_text(encoding, errors), universal newlines included, of the
    file the task's commands see at `path`; past the answer's cap, refused."""
    path = str(body.get("path", ""))
    data = _run(service, "file-read", fileops.read_op(path, service.cap), path, request_id)
    if len(data) > service.cap:
        raise swerex_error(
            "SwerexException",
            f"{path} is larger than the answer's cap of {service.cap} bytes "
            "(SETTLED_SWEREX_OUTPUT_CAP on the server): read it in parts with a command",
        )
    encoding, errors = body.get("encoding"), body.get("errors")
    return {"content": io.TextIOWrapper(io.BytesIO(data), encoding, errors).read()}


def write_file(service: SwerexService, body: Body, request_id: str | None) -> Body:
    """As SWE-ReX's Path.write_text(content), its parents made, as the task's commands write;
    UTF-8, a surrogate-escaped byte written back as that byte."""
    path = str(body.get("path", ""))
    data = str(body.get("content", "")).encode("utf-8", "surrogateescape")
    refuse_size(len(data), f"write_file {path}")
    _run(service, "file-write", fileops.write_op(path, data), path, request_id)
    return {}


def upload(
    service: SwerexService, data: bytes, target: str, unzip: bool, request_id: str | None
) -> Body:
    """SWE-ReX's upload: a file written at `target`, or (`unzip`) a zipped directory unpacked
    into `target`, made with its parents; a member whose name leaves it is refused."""
    refuse_size(len(data), f"upload to {target}")
    if not unzip:
        _run(service, "upload", fileops.write_op(target, data), target, request_id)
        return {}
    try:
        tar = fileops.zip_as_tar(data, target, MAX_FILE_BYTES)
    except (fileops.ArchiveRefused, zipfile.BadZipFile) as exc:
        raise swerex_error("SwerexException", f"upload to {target}: {exc}") from None
    _run(service, "upload", fileops.unpack_op(target, tar), target, request_id)
    return {}


def refuse_size(size: int, what: str) -> None:
    """Refused past MAX_FILE_BYTES, naming the size and the limit."""
    if size > MAX_FILE_BYTES:
        raise swerex_error(
            "SwerexException",
            f"{what}: {size} bytes, over the limit of {MAX_FILE_BYTES} bytes for one file call",
        )


def _run(
    service: SwerexService, kind: str, op: fileops.FileOp, path: str, request_id: str | None
) -> bytes:
    """The operation as a session of the task keyed swerex:<kind>:<n> (a retry: the same n);
    its answer, or Python's own error for what its script said."""
    with service.lock:
        position = service.file_ops.take(request_id)
    with service.runtime() as runtime:
        task, _workspace = service.open_task(runtime)
        result = run_step(
            runtime,
            task,
            argv=op.argv,
            key=f"swerex:{kind}:{position}",
            timeout=FILE_OP_TIMEOUT_S,
            stdin=op.stdin,
        )
    return fileops.answer(result, path)
