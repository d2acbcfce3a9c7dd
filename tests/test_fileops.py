"""settled.integrations.fileops on its own: the zipped directory SWE-ReX uploads becomes the
tar the unpack script reads, every byte and mode kept, and what would leave its target or
unzip past its limit is refused before any command runs."""

from __future__ import annotations

import io
import tarfile
import zipfile

import pytest

from settled.integrations import fileops


def _zip(members: dict[str, tuple[bytes, int]]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, (data, mode) in members.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            archive.writestr(info, data)
    return buffer.getvalue()


def test_a_zip_becomes_a_tar_with_its_bytes_and_modes() -> None:
    data = _zip({"d/": (b"", 0o40755), "d/x.txt": (b"x\n", 0o644), "run.sh": (b"#!", 0o755)})
    with tarfile.open(fileobj=io.BytesIO(fileops.zip_as_tar(data, "t", 100))) as tar:
        got = {m.name: (m.type, m.mode, _content(tar, m)) for m in tar.getmembers()}
    assert got == {
        "d": (tarfile.DIRTYPE, 0o755, b""),
        "d/x.txt": (tarfile.REGTYPE, 0o644, b"x\n"),
        "run.sh": (tarfile.REGTYPE, 0o755, b"#!"),
    }


def _content(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member) if member.isfile() else None
    return handle.read() if handle is not None else b""


@pytest.mark.parametrize("name", ["../up.txt", "/abs.txt", "a/../../up.txt"])
def test_a_member_outside_the_target_is_refused(name: str) -> None:
    with pytest.raises(fileops.ArchiveRefused, match="escapes t"):
        fileops.zip_as_tar(_zip({name: (b"x", 0o644)}), "t", 100)


def test_a_zip_that_unzips_past_its_limit_is_refused_before_it_is_read() -> None:
    data = _zip({"big": (b"\0" * 4096, 0o644)})  # a few dozen bytes zipped
    with pytest.raises(fileops.ArchiveRefused, match="4096 bytes, over the limit of 4095"):
        fileops.zip_as_tar(data, "t", 4095)
    assert fileops.zip_as_tar(data, "t", 4096)
