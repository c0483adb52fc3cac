"""The backend as the lifecycle layer sees it: method name and bytes in, bytes out.

Keeping this a Protocol (rather than a grpc stub) is what lets the transport be
swapped for a faster data plane later without touching the lifecycle or hooks.
Status codes are gRPC's numeric codes, which are part of the wire protocol and
not of any library.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from runtimeproxy.errors import PeerError

Metadata = Sequence[tuple[str, str | bytes]]
#: The prefix of the image service's methods (served by the image endpoint when it has one).
IMAGE_SERVICE: Final = "/runtime.v1.ImageService/"


class Code(enum.IntEnum):
    """gRPC status codes (numbers are fixed by the gRPC protocol)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class CallError(PeerError):
    """A call ended with a non-OK status; carries everything needed to relay it."""

    def __init__(self, code: Code, details: str, trailing_metadata: Metadata = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.trailing_metadata = tuple(trailing_metadata)


@dataclass(frozen=True, slots=True)
class Reply:
    payload: bytes
    initial_metadata: Metadata = ()
    trailing_metadata: Metadata = ()


class Backend(Protocol):
    """containerd's CRI endpoint. ``method`` is the full gRPC path
    (``/runtime.v1.RuntimeService/Version``)."""

    async def unary(
        self, method: str, payload: bytes, *, timeout: float | None = None, metadata: Metadata = ()
    ) -> Reply: ...
