"""What an S3 error answer means (issue 39, item 9): a full store is not an unreachable one.

``classify`` is a pure decision, so a table hands it answers (status, code, message) as S3
services send them. SeaweedFS 4.48 answers a full volume with a bare ``500 InternalError``
("We encountered an internal error"), the same as any other fault, so no real server here can
show the full case: the store is tried with one botocore ``ClientError`` built from such an
answer (no network), and the credentials case on the real server (``tests/s3.py``).
"""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from settled.errors import SpaceExhausted
from settled.objects import ObjectStoreFull, ObjectStoreRefused, ObjectStoreUnreachable
from settled.objects.s3 import FULL, OTHER, REFUSED, TRANSIENT, S3ObjectStore, classify, open_s3

ANSWERS = [
    (507, "InsufficientStorage", "Insufficient Storage", FULL),
    (403, "QuotaExceeded", "You have reached a quota limit", FULL),
    (400, "EntityTooLarge", "Your proposed upload exceeds the maximum allowed size", FULL),
    (
        507,
        "XMinioStorageFull",
        "Storage backend has reached its minimum free drive threshold",
        FULL,
    ),
    (500, "InternalError", "write: no space left on device", FULL),
    (403, "AccessDenied", "Access Denied", REFUSED),
    (403, "SignatureDoesNotMatch", "The request signature we calculated does not match", REFUSED),
    (403, "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist", REFUSED),
    (500, "InternalError", "We encountered an internal error, please try again.", TRANSIENT),
    (503, "SlowDown", "Please reduce your request rate.", TRANSIENT),
    (429, "429", "", TRANSIENT),
    (400, "RequestTimeout", "Your socket connection to the server was not read from", TRANSIENT),
    (404, "NoSuchBucket", "The specified bucket does not exist", OTHER),
    (404, "NoSuchKey", "The specified key does not exist.", OTHER),
    (
        412,
        "PreconditionFailed",
        "At least one of the pre-conditions you specified did not hold",
        OTHER,
    ),
]


@pytest.mark.parametrize(("status", "code", "message", "kind"), ANSWERS)
def test_each_answer_is_classified(status: int, code: str, message: str, kind: str) -> None:
    assert classify(status, code, message) == kind


def _answer(status: int, code: str, message: str) -> ClientError:
    body = {
        "Error": {"Code": code, "Message": message},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(body, "PutObject")  # type: ignore[arg-type]


def test_a_full_store_is_one_line_at_once_never_retried_and_never_unreachable() -> None:
    store = S3ObjectStore("bucket-x", "pre", endpoint="http://127.0.0.1:9")
    calls = []

    def full() -> None:
        calls.append(1)
        raise _answer(507, "InsufficientStorage", "Insufficient Storage\nto hold the object")

    with pytest.raises(ObjectStoreFull) as caught:
        store._call(full)
    assert len(calls) == 1  # no retry makes room
    error = caught.value
    assert isinstance(error, SpaceExhausted) and not isinstance(error, ObjectStoreUnreachable)
    assert error.exit_code == 3  # blocked until space is made, as a full home
    text = str(error)
    assert "\n" not in text and "s3://bucket-x/pre" in text and "InsufficientStorage" in text
    assert "is full" in text and "unreachable" not in text and "cannot be used" not in text


def test_a_full_answer_to_an_object_request_is_full_too() -> None:
    store = S3ObjectStore("bucket-x", "pre")
    with pytest.raises(ObjectStoreFull, match="QuotaExceeded"):
        store._raise(_answer(403, "QuotaExceeded", "quota"), "sha256:" + "0" * 64)


def test_refused_credentials_on_the_real_server_are_refused_not_full(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ObjectStoreRefused) as caught:
        open_s3(s3_url).put_bytes(b"x")
    assert not isinstance(caught.value, SpaceExhausted)
    assert "not-the-secret" not in str(caught.value)
