"""The part of ``mooncake.engine.TransferEngine`` that SGLang's mooncake connector calls, on CPU memory: each write
goes over a loopback TCP connection to the peer engine's listener, which copies the bytes to the destination
address in its own process (where SGLang registered that memory). Registration is a no-op. Test-only."""

from __future__ import annotations

import ctypes
import socket
import struct
import threading
from typing import Any

_BLOCK = struct.Struct("<QQ")


def _recv(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed")
        buf += part
    return bytes(buf)


class TransferEngine:
    def __init__(self) -> None:
        self._port = 0

    def initialize(self, hostname: str, metadata: str, protocol: str, device: str) -> int:
        listener = socket.create_server(("127.0.0.1", 0))
        self._port = listener.getsockname()[1]
        threading.Thread(target=self._serve, args=(listener,), daemon=True).start()
        return 0

    def _serve(self, listener: socket.socket) -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=self._copy_in, args=(conn,), daemon=True).start()

    def _copy_in(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    (count,) = struct.unpack("<Q", _recv(conn, 8))
                except ConnectionError:
                    return
                for _ in range(count):
                    dst, length = _BLOCK.unpack(_recv(conn, _BLOCK.size))
                    ctypes.memmove(dst, _recv(conn, length), length)
                conn.sendall(b"\x01")

    def get_rpc_port(self) -> int:
        return self._port

    def register_memory(self, ptr: int, length: int) -> int:
        return 0

    def unregister_memory(self, ptr: int) -> int:
        return 0

    def batch_register_memory(self, ptrs: list[int], lengths: list[int]) -> int:
        return 0

    def batch_unregister_memory(self, ptrs: list[int]) -> int:
        return 0

    def transfer_sync_write(self, session: str, src: int, dst: int, length: int) -> int:
        return self.batch_transfer_sync_write(session, [src], [dst], [length])

    def batch_transfer_sync_write(self, session: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> int:
        host, port = session.rsplit(":", 1)
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=30) as conn:
                conn.sendall(struct.pack("<Q", len(srcs)))
                for src, dst, length in zip(srcs, dsts, lengths, strict=True):
                    conn.sendall(_BLOCK.pack(dst, length) + ctypes.string_at(src, length))
                return 0 if _recv(conn, 1) == b"\x01" else -1
        except OSError:
            return -1

    def send_probe(self, session: str) -> int:
        return 0

    def get_engine(self) -> Any:
        return self
