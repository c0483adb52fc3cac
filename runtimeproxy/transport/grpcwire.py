"""gRPC's wire conventions over HTTP/1.1, for the interception hop behind HAProxy.

HAProxy converts kubelet's HTTP/2 to HTTP/1.1 towards Python and back (trailers
included), so the interception server and its backend client speak plain HTTP/1.1 on
the event loop instead of running grpc.aio (see ``runtimeproxy.transport.h1server`` and
``runtimeproxy.transport.h1backend``; the measurement is in docs/benchmarks.md). What gRPC puts
in HTTP headers is here: the 5-byte message frame, ``grpc-timeout``, metadata (``-bin``
values in base64), ``grpc-message``'s percent-encoding, and the status of a reply that
is no gRPC reply (gRPC's HTTP-to-status mapping).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Mapping
from typing import Final
from urllib.parse import quote, unquote_to_bytes

from runtimeproxy.backend import CallError, Code, Metadata

#: Headers of HTTP or of gRPC itself: never metadata, never relayed as metadata.
RESERVED: Final = frozenset({
    b"host", b"content-type", b"content-length", b"transfer-encoding", b"te", b"connection", b"keep-alive",
    b"user-agent", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding", b"grpc-status",
    b"grpc-message", b"date", b"server", b"proxy-connection", b"upgrade",
})
_UNITS: Final = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_TIMEOUT: Final = re.compile(rb"([0-9]{1,8})([HMSmun])")
#: gRPC's mapping of an HTTP status that carries no grpc-status (a proxy's own answer).
_HTTP_STATUS: Final[Mapping[int, Code]] = {
    400: Code.INTERNAL, 401: Code.UNAUTHENTICATED, 403: Code.PERMISSION_DENIED, 404: Code.UNIMPLEMENTED,
    429: Code.UNAVAILABLE, 502: Code.UNAVAILABLE, 503: Code.UNAVAILABLE, 504: Code.UNAVAILABLE,
}
#: A metadata key as gRPC allows it (lowercase, digits, ``-_.``).
_KEY: Final = re.compile(r"[0-9a-z_.\-]+")
#: What grpc-message keeps unescaped: printable ASCII but ``%`` (gRPC's spec).
_MESSAGE_SAFE: Final = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def frame(payload: bytes) -> bytes:
    """One uncompressed gRPC message on the wire."""
    return b"\0" + len(payload).to_bytes(4, "big") + payload


def unframe(body: bytes, max_bytes: int, side: str) -> bytes:
    """The one message of a unary call's body; CallError if it is not exactly one
    uncompressed message of at most ``max_bytes`` (``side``: whose message, for the error)."""
    if len(body) < 5:
        raise CallError(Code.INTERNAL, f"{side}: no gRPC message in a body of {len(body)} bytes")
    if body[0] != 0:
        raise CallError(Code.UNIMPLEMENTED, f"{side}: compressed messages are not accepted (flag {body[0]})")
    length = int.from_bytes(body[1:5], "big")
    if length > max_bytes:
        raise CallError(Code.RESOURCE_EXHAUSTED, f"{side}: message of {length} bytes, more than {max_bytes}")
    if length != len(body) - 5:
        raise CallError(Code.INTERNAL, f"{side}: one message of {length} bytes framed, the body has {len(body) - 5}")
    return body[5:]


def parse_timeout(value: bytes) -> float:
    """``grpc-timeout`` (1 to 8 digits and a unit) in seconds; CallError naming the value if malformed."""
    m = _TIMEOUT.fullmatch(value.strip())
    if m is None:
        raise CallError(Code.INTERNAL, f"malformed grpc-timeout {value.decode('latin-1')!r}")
    return int(m.group(1)) * _UNITS[m.group(2)]


def format_timeout(seconds: float) -> bytes:
    """``grpc-timeout`` for ``seconds``: the finest unit whose value fits 8 digits, rounded up."""
    for unit, scale in ((b"u", 1e6), (b"m", 1e3), (b"S", 1.0), (b"M", 1 / 60), (b"H", 1 / 3600)):
        value = -int(-max(seconds, 0.0) * scale // 1)  # ceil
        if value <= 99_999_999:
            return str(max(value, 1)).encode() + unit
    return b"99999999H"


def decode_metadata(headers: Iterable[tuple[bytes, bytes]]) -> Metadata:
    """Metadata from HTTP headers, as grpc gives it: str values, bytes for ``-bin`` keys
    (base64, padded or not). Reserved headers are left out; a ``-bin`` value that is no
    base64 is a CallError naming the key."""
    out: list[tuple[str, str | bytes]] = []
    for name, value in headers:
        if name in RESERVED:
            continue
        key = name.decode("latin-1").lower()
        if key.endswith("-bin"):
            try:
                out.append((key, base64.b64decode(value + b"=" * (-len(value) % 4), validate=True)))
            except binascii.Error:
                raise CallError(Code.INTERNAL, f"metadata {key}: not base64") from None
        else:
            out.append((key, value.decode("latin-1")))
    return tuple(out)


def encode_metadata(metadata: Metadata) -> bytes:
    """HTTP header lines for metadata (``-bin`` values in unpadded base64). A key gRPC
    would refuse or a value with a control character is a CallError: nothing we relay
    can add a header line of its own."""
    lines = []
    for key, value in metadata:
        if not _KEY.fullmatch(key) or key.encode() in RESERVED:
            raise CallError(Code.INTERNAL, f"metadata key {key!r} cannot be relayed")
        if isinstance(value, bytes):
            data = base64.b64encode(value).rstrip(b"=") if key.endswith("-bin") else value
        else:
            data = value.encode("latin-1", "replace")
        if any(c < 0x20 or c == 0x7F for c in data):
            raise CallError(Code.INTERNAL, f"metadata {key}: a control character in its value")
        lines.append(key.encode() + b": " + data + b"\r\n")
    return b"".join(lines)


def encode_message(details: str) -> bytes:
    """``grpc-message``: percent-encoded UTF-8."""
    return quote(details, safe=_MESSAGE_SAFE, encoding="utf-8").encode("ascii")


def decode_message(value: bytes) -> str:
    return unquote_to_bytes(value).decode("utf-8", "replace")


def status_of(http_status: int, grpc_status: bytes | None, grpc_message: bytes | None) -> tuple[Code, str]:
    """The call's status from a reply's HTTP status and its grpc-status/grpc-message."""
    if grpc_status is None:
        if http_status == 200:
            return Code.INTERNAL, "the reply ended without a grpc-status"
        return _HTTP_STATUS.get(http_status, Code.UNKNOWN), f"HTTP status {http_status} with no grpc-status"
    try:
        code = Code(int(grpc_status))
    except ValueError:
        code = Code.UNKNOWN
    return code, decode_message(grpc_message) if grpc_message else ""
