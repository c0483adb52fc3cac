"""A raw HTTP/2 client, just enough to see a gRPC response's frames: one unary call on
a unix socket, and the frames of its stream as (type, flags, payload length).

grpc clients hide how a status arrived; a trailers-only response (one HEADERS frame
with END_STREAM, grpc-status in it) and headers + trailers look the same to them.
Requests use HPACK literals without indexing or Huffman coding; responses are not
decoded (only frame types and flags are looked at). Blocking: call it in a thread when
the server runs on the same event loop.
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path
from typing import Final, NamedTuple

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4


class Frame(NamedTuple):
    type: int
    flags: int
    stream: int
    length: int


def _literal(name: str, value: str) -> bytes:
    """HPACK literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    out = b"\x00"
    for text in (name.encode(), value.encode()):
        if len(text) >= 127:
            raise ValueError("only short header fields")
        out += bytes([len(text)]) + text
    return out


def _frame(type_: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([type_, flags]) + struct.pack(">I", stream) + payload


def _read(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def unary(path: Path, method: str, message: bytes, timeout: float = 5.0) -> list[Frame]:
    """The response frames of stream 1 (HEADERS, DATA, RST_STREAM) for one unary gRPC call."""
    headers = b"".join(_literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", method), (":authority", "localhost"),
        ("content-type", "application/grpc"), ("te", "trailers"),
    ))
    body = b"\x00" + struct.pack(">I", len(message)) + message
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(PREFACE + _frame(SETTINGS, 0, 0, b"")
                     + _frame(HEADERS, END_HEADERS, 1, headers) + _frame(DATA, END_STREAM, 1, body))
        frames: list[Frame] = []
        while True:
            head = _read(sock, 9)
            length = int.from_bytes(head[:3], "big")
            type_, flags = head[3], head[4]
            stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
            _read(sock, length)
            if type_ == SETTINGS and not flags & ACK:
                sock.sendall(_frame(SETTINGS, ACK, 0, b""))
            if type_ == GOAWAY:
                raise ConnectionError("GOAWAY before the call ended")
            if stream != 1 or type_ not in (HEADERS, DATA, RST_STREAM):  # WINDOW_UPDATE: flow control
                continue
            frames.append(Frame(type_, flags, stream, length))
            if type_ == RST_STREAM or (type_ in (HEADERS, DATA) and flags & END_STREAM):
                return frames
