"""The NRI mux + ttRPC framing (runtimeproxy.nri.wire): the exact bytes of the protocol
reference (shared/reference/nri-protocol.md 5.6), the 4096-byte send limit, reassembly
of bigger received frames and of messages split across frames, and one connection
over a real socketpair."""

from __future__ import annotations

import asyncio
import socket

import pytest

from criapi import nri_v1alpha1_pb2 as nri
from criapi import ttrpc_pb2
from runtimeproxy.nri import wire

# RegisterPlugin from plugin "10-refplug" on channel 2, stream 1 (reference 5.6).
REGISTER_BYTES = bytes.fromhex(
    "00000002 00000047 0000003d 00000001 0100".replace(" ", "")
) + b"\x0a\x1cnri.pkg.api.v1alpha1.Runtime" + b"\x12\x0eRegisterPlugin" + b"\x1a\x0d\x0a\x07refplug\x12\x0210"


def _register_message() -> wire.Message:
    req = ttrpc_pb2.Request(service=wire.RUNTIME_SERVICE, method="RegisterPlugin",
                            payload=nri.RegisterPluginRequest(plugin_name="refplug", plugin_idx="10")
                            .SerializeToString())
    return wire.Message(1, wire.REQUEST, 0, req.SerializeToString())


def test_register_plugin_bytes_match_the_reference() -> None:
    out = b"".join(wire.frames(wire.RUNTIME_CHANNEL, wire.encode_message(_register_message())))
    assert out == REGISTER_BYTES
    assert len(out) == 79


def test_configure_reply_bytes_match_the_reference() -> None:
    reply = ttrpc_pb2.Response(payload=nri.ConfigureResponse(events=0x22D).SerializeToString())
    out = b"".join(wire.frames(wire.PLUGIN_CHANNEL, wire.encode_message(
        wire.Message(1, wire.RESPONSE, 0, reply.SerializeToString()))))
    assert out.hex() == "000000010000000f" "00000005000000010200" "120310ad04"


def test_a_big_message_goes_out_in_frames_of_at_most_4096_bytes() -> None:
    data = bytes(range(256)) * 40  # 10240 bytes
    out = list(wire.frames(wire.PLUGIN_CHANNEL, wire.encode_message(wire.Message(3, wire.RESPONSE, 0, data))))
    sizes = [wire.MUX_HEADER.unpack_from(f)[1] for f in out]
    assert sizes == [4096, 4096, 10250 - 8192]
    assert all(len(f) == wire.MUX_HEADER.size + s for f, s in zip(out, sizes, strict=True))
    # Reassembled on the other side, whole.
    got = wire.Demux().feed(b"".join(out))
    assert got == [(wire.PLUGIN_CHANNEL, wire.Message(3, wire.RESPONSE, 0, data))]


def test_demux_reassembles_a_received_frame_bigger_than_4096_and_split_reads() -> None:
    """containerd sends a 9 KB request as 4096 + 4836: the reader takes any frame size,
    and bytes arriving one at a time make the same messages."""
    data = b"x" * 9000
    msg = wire.encode_message(wire.Message(5, wire.REQUEST, 0, data))
    stream = (wire.MUX_HEADER.pack(1, 4096) + msg[:4096]
              + wire.MUX_HEADER.pack(1, len(msg) - 4096) + msg[4096:])
    assert wire.Demux().feed(stream) == [(1, wire.Message(5, wire.REQUEST, 0, data))]
    demux, got = wire.Demux(), []
    for i in range(len(stream)):
        got.extend(demux.feed(stream[i:i + 1]))
    assert got == [(1, wire.Message(5, wire.REQUEST, 0, data))]


def test_demux_keeps_the_two_channels_apart() -> None:
    a = wire.encode_message(wire.Message(1, wire.REQUEST, 0, b"a" * 30))
    b = wire.encode_message(wire.Message(1, wire.RESPONSE, 0, b"b" * 30))
    # Interleaved halves: channel 1's message is completed only by its second frame.
    stream = (wire.MUX_HEADER.pack(1, 20) + a[:20] + wire.MUX_HEADER.pack(2, len(b)) + b
              + wire.MUX_HEADER.pack(1, len(a) - 20) + a[20:])
    got = wire.Demux().feed(stream)
    assert got == [(2, wire.Message(1, wire.RESPONSE, 0, b"b" * 30)), (1, wire.Message(1, wire.REQUEST, 0, b"a" * 30))]


def test_demux_refuses_a_message_over_the_ttrpc_limit() -> None:
    header = wire.TTRPC_HEADER.pack(wire.MAX_MESSAGE + 1, 1, wire.REQUEST, 0)
    with pytest.raises(wire.ProtocolError, match="ttrpc message"):
        wire.Demux().feed(wire.MUX_HEADER.pack(1, len(header)) + header)


@pytest.mark.asyncio
async def test_connection_serves_channel_1_while_its_channel_2_call_waits() -> None:
    """The handshake's order: containerd sends Configure before answering RegisterPlugin;
    the plugin answers it (frames ≤ 4096 even for a 6 KB reply) and then gets its reply."""
    ours, theirs = socket.socketpair()
    big = "v" * 6000

    async def handler(method: str, payload: bytes, timeout: float | None) -> bytes:
        assert method == "Configure" and timeout == pytest.approx(2.0)
        if nri.ConfigureRequest.FromString(payload).runtime_name != "containerd":
            raise wire.RpcError(wire.UNKNOWN, "who are you")
        return nri.CreateContainerResponse(adjust=nri.ContainerAdjustment(annotations={"k": big})).SerializeToString()

    reader, writer = await asyncio.open_unix_connection(sock=ours)
    conn = wire.Connection(reader, writer, handler)
    serving = asyncio.create_task(conn.serve())
    peer_reader, peer_writer = await asyncio.open_unix_connection(sock=theirs)
    call = asyncio.create_task(conn.call("RegisterPlugin", nri.RegisterPluginRequest(plugin_name="p", plugin_idx="10"),
                                         nri.Empty, timeout=5))
    demux = wire.Demux()
    raw = bytearray()

    async def next_message() -> tuple[int, wire.Message]:
        while True:
            data = await asyncio.wait_for(peer_reader.read(65536), 5)
            raw.extend(data)
            got = demux.feed(data)
            if got:
                assert len(got) == 1
                return got[0]

    channel, msg = await next_message()
    assert channel == wire.RUNTIME_CHANNEL and msg.stream == 1
    assert ttrpc_pb2.Request.FromString(msg.data).method == "RegisterPlugin"
    configure = ttrpc_pb2.Request(service=wire.PLUGIN_SERVICE, method="Configure", timeout_nano=2_000_000_000,
                                  payload=nri.ConfigureRequest(runtime_name="containerd").SerializeToString())
    peer_writer.write(b"".join(wire.frames(1, wire.encode_message(
        wire.Message(1, wire.REQUEST, 0, configure.SerializeToString())))))
    raw.clear()
    channel, msg = await next_message()
    assert channel == wire.PLUGIN_CHANNEL and msg.kind == wire.RESPONSE
    reply = ttrpc_pb2.Response.FromString(msg.data)
    assert nri.CreateContainerResponse.FromString(reply.payload).adjust.annotations["k"] == big
    # Every frame of that reply carried at most 4096 bytes.
    offset, sizes = 0, []
    while offset < len(raw):
        size = wire.MUX_HEADER.unpack_from(raw, offset)[1]
        sizes.append(size)
        offset += wire.MUX_HEADER.size + size
    assert len(sizes) >= 2 and max(sizes) <= wire.MAX_FRAME_PAYLOAD
    assert not call.done()  # the call is still waiting: serving channel 1 did not depend on it
    peer_writer.write(b"".join(wire.frames(2, wire.encode_message(wire.Message(1, wire.RESPONSE, 0, b"")))))
    assert await asyncio.wait_for(call, 5) == nri.Empty()
    # An error status from a handler goes back as status (code, message).
    bad = ttrpc_pb2.Request(service=wire.PLUGIN_SERVICE, method="Configure", timeout_nano=2_000_000_000,
                            payload=nri.ConfigureRequest(runtime_name="x").SerializeToString())
    peer_writer.write(b"".join(wire.frames(1, wire.encode_message(wire.Message(3, wire.REQUEST, 0,
                                                                                bad.SerializeToString())))))
    _, msg = await next_message()
    status = ttrpc_pb2.Response.FromString(msg.data).status
    assert (msg.stream, status.code, status.message) == (3, wire.UNKNOWN, "who are you")
    peer_writer.close()
    await asyncio.wait_for(serving, 5)
    assert conn.closed.is_set()
