"""A raw HTTP/2 client, just enough to see a gRPC response's frames: one call on a unix
socket, with any request headers (any ``:authority``, or none at all; headers of any
size or count), and the frames of its stream as (type, flags, stream, length, payload).

grpc clients hide how a status arrived; a trailers-only response (one HEADERS frame
with END_STREAM, grpc-status in it) and headers + trailers look the same to them. And a
grpc client cannot send what kubelet's older grpc-go sends (a socket path as
``:authority``), nor what a hostile peer sends. Requests use HPACK literals without
indexing or Huffman coding; responses are not decoded (frame types, flags and DATA
payloads are what the tests look at). Blocking: call it in a thread when the server
runs on the same event loop.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Final, NamedTuple

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, CONTINUATION = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x9
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
#: The peer's SETTINGS_MAX_FRAME_SIZE before it says otherwise (RFC 9113 6.5.2).
MAX_FRAME: Final = 16384
#: Leave the header out (``authority=ABSENT``).
ABSENT: Final = None


class Frame(NamedTuple):
    type: int
    flags: int
    stream: int
    length: int
    payload: bytes = b""


def _integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 5.1) with ``first``'s high bits in the first byte."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = bytearray([first | limit]), value - limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: str, value: str) -> bytes:
    """HPACK literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    out = b"\x00"
    for text in (name.encode("latin-1"), value.encode("latin-1")):
        out += _integer(len(text), 7) + text
    return out


def _frame(type_: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([type_, flags]) + struct.pack(">I", stream) + payload


def _header_frames(block: bytes, end_stream: bool) -> bytes:
    """HEADERS, then CONTINUATION frames for a block larger than one frame."""
    chunks = [block[i:i + MAX_FRAME] for i in range(0, len(block), MAX_FRAME)] or [b""]
    out = b""
    for i, chunk in enumerate(chunks):
        flags = END_HEADERS if i == len(chunks) - 1 else 0
        if i == 0:
            out += _frame(HEADERS, flags | (END_STREAM if end_stream else 0), 1, chunk)
        else:
            out += _frame(CONTINUATION, flags, 1, chunk)
    return out


def _read(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def grpc_headers(method: str, authority: str | None = "localhost",
                 extra: Sequence[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """The request headers a grpc client sends, ``:authority`` as given (None: left out)."""
    head = [(":method", "POST"), (":scheme", "http"), (":path", method)]
    if authority is not None:
        head.append((":authority", authority))
    return [*head, ("content-type", "application/grpc"), ("te", "trailers"), *extra]


def grpc_message(message: bytes, announced: int | None = None) -> bytes:
    """One length-prefixed gRPC message; ``announced``: the length its prefix claims."""
    return b"\x00" + struct.pack(">I", len(message) if announced is None else announced) + message


def call(path: Path, headers: Sequence[tuple[str, str]], body: bytes, timeout: float = 5.0,
         end_stream: bool = True) -> list[Frame]:
    """The response frames of stream 1 (HEADERS, DATA, RST_STREAM) for one request; a
    GOAWAY before the stream ended is a ConnectionError (its payload in the message).
    ``end_stream=False``: the body is sent and the request left open (a body announced
    longer than what is sent): the answer must come without the rest."""
    block = b"".join(_literal(k, v) for k, v in headers)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(PREFACE + _frame(SETTINGS, 0, 0, b"") + _header_frames(block, end_stream=not body and end_stream))
        for i in range(0, len(body), MAX_FRAME):
            last = i + MAX_FRAME >= len(body)
            sock.sendall(_frame(DATA, END_STREAM if last and end_stream else 0, 1, body[i:i + MAX_FRAME]))
        frames: list[Frame] = []
        while True:
            head = _read(sock, 9)
            length = int.from_bytes(head[:3], "big")
            type_, flags = head[3], head[4]
            stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
            payload = _read(sock, length)
            if type_ == SETTINGS and not flags & ACK:
                sock.sendall(_frame(SETTINGS, ACK, 0, b""))
            if type_ == GOAWAY:
                raise ConnectionError(f"GOAWAY before the call ended: {payload[8:]!r}")
            if stream != 1 or type_ not in (HEADERS, DATA, RST_STREAM):  # WINDOW_UPDATE: flow control
                continue
            frames.append(Frame(type_, flags, stream, length, payload))
            if type_ == RST_STREAM or (type_ in (HEADERS, DATA) and flags & END_STREAM):
                return frames


def unary(path: Path, method: str, message: bytes, timeout: float = 5.0,
          authority: str | None = "localhost") -> list[Frame]:
    """The response frames of stream 1 for one unary gRPC call."""
    return call(path, grpc_headers(method, authority), grpc_message(message), timeout)


def reply_message(frames: Sequence[Frame]) -> bytes | None:
    """The one reply message of a successful unary call (HEADERS, DATA, trailers), else None."""
    shape = [(f.type, f.flags & END_STREAM) for f in frames]
    if shape[:1] != [(HEADERS, 0)] or shape[-1:] != [(HEADERS, END_STREAM)]:
        return None
    body = b"".join(f.payload for f in frames if f.type == DATA)
    if len(body) < 5 or int.from_bytes(body[1:5], "big") != len(body) - 5:
        return None
    return body[5:]
