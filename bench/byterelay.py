"""The floor for a CRI data plane: an asyncio byte relay between two unix sockets.

No HTTP/2 parsing, no routing: every accepted connection gets its own connection to
the backend and bytes are copied both ways. Not a product (it cannot route a method to
the hooks or refuse one); the benchmark's lower bound for "a proxy in the way".

    python bench/byterelay.py LISTEN_SOCKET BACKEND_SOCKET
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(262144):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def main(listen: str, backend: str) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            backend_r, backend_w = await asyncio.open_unix_connection(backend)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pump(client_r, backend_w), _pump(backend_r, client_w))

    with contextlib.suppress(FileNotFoundError):
        os.unlink(listen)
    server = await asyncio.start_unix_server(handle, listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    async with server:
        await stop.wait()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(listen)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
