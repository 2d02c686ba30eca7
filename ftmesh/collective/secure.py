"""Encrypted ring connections: AES-256-GCM per frame, counter nonces, one key per direction.

Theory of operation: when the mesh encrypts (``MeshAuth.encrypt``), the handshake of every
data-plane connection (see ``transport``) derives two keys from the mesh key and the MACed
transcript, which carries a fresh random nonce from each side: one for the forward direction
(collective bytes, client to server) and one for the reverse direction (``READY`` frames and
abort notices). Each direction numbers its frames from 0 and uses the number as the GCM nonce,
so no key meets a nonce twice, and a frame that is dropped, replayed, reordered or moved to
another connection fails its tag.

On the wire a frame keeps its 8-byte head ``u32 kind, u32 length`` in the clear, as associated
data, with ``length`` counting the 16-byte tag, and its payload becomes ciphertext + tag. Frames
without a payload (``DONE``, ``KEEPALIVE``) carry a tag alone; ``READY``, whose length field
holds a sequence number, is followed by a tag alone.

``FrameOpener`` presents the engine exactly the plaintext frame stream it reads from a plain
socket (heads with the plaintext length, then payloads), through the same ``recv_into`` and
``recv`` calls, so the engine's state machine is the same with and without encryption:

* a frame without a payload is verified before its head is handed out;
* a frame with a payload hands its head out once the whole ciphertext is buffered; when the
  engine then asks for the payload with a buffer that can hold all of it (the normal case: the
  chunk's place in the output, or the reduction scratch), the ciphertext is decrypted straight
  into that buffer, so the only copy the encryption adds is the cipher's own pass. A failed tag
  raises ``RemoteProtocolError("bad_mac")`` and the collective aborts; what was written into
  the buffer by then is not used (an aborted collective's output is undefined anyway).

``FrameSealer`` builds the frames of one direction. The engine's transmit path seals a frame
when it queues it and writes it with ``sendmsg`` as before; the best-effort sends made outside
it (``READY``, abort notices) go through ``send_nowait``, which numbers a frame only if its
bytes went out, so a full socket never leaves a gap in the numbering. An abort forwarded while
a sealed frame is queued but not started replaces that frame under its number
(``send_instead_nowait``).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import RemoteProtocolError
from ..security import AEAD_TAG_BYTES, MeshAuth, new_aead
from . import wire

TAG = AEAD_TAG_BYTES
_NONCE = struct.Struct("<4xQ")
"""12-byte GCM nonce: the frame number, little-endian, after 4 zero bytes."""
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_HEAD = wire.FRAME.size


def _blank(n: int) -> Any:
    return memoryview(bytearray(n))


@dataclass(frozen=True)
class SessionKeys:
    """The two keys of one connection (derived in the handshake)."""

    forward: bytes
    """Client (the sending member) to server: collective frames."""
    reverse: bytes
    """Server to client: ``READY`` frames and abort notices."""


def session_keys(auth: MeshAuth, index: int, transcript: bytes) -> SessionKeys:
    """Keys of one connection from mesh key ``index`` (the one that made the server's tag, so
    both sides pick the same during a key rotation) and the handshake transcript."""
    return SessionKeys(
        forward=auth.derive(index, b"dp-forward", transcript),
        reverse=auth.derive(index, b"dp-reverse", transcript),
    )


class FrameSealer:
    """Seals the frames of one direction of one connection. Thread-safe."""

    def __init__(self, key: bytes) -> None:
        self._aead = new_aead(key)
        self._encrypt_into: Callable[..., Any] | None = getattr(self._aead, "encrypt_into", None)
        self._next = 0
        self._lock = threading.Lock()
        self._data_buf: Any = None

    def _seal(self, n: int, kind: int, payload: bytes | memoryview, field: int) -> list[memoryview]:
        length = field if kind == wire.READY else len(payload) + TAG
        head = wire.FRAME.pack(kind, length)
        return [memoryview(head), memoryview(self._aead.encrypt(_NONCE.pack(n), payload, head))]

    def seal(
        self, kind: int, payload: bytes | memoryview = b"", field: int = 0
    ) -> list[memoryview]:
        """The buffers of one frame (``field`` is the length field of ``READY`` frames). The
        caller must write them, in the order frames were sealed."""
        with self._lock:
            n = self._next
            self._next += 1
        return self._seal(n, kind, payload, field)

    def seal_data(self, payload: memoryview) -> list[memoryview]:
        """Like ``seal(DATA, payload)`` but into a buffer this sealer reuses (no allocation per
        chunk): the result is only valid until the next ``seal_data``. The engine writes one
        frame completely before it seals the next."""
        if self._encrypt_into is None:  # pragma: no cover - cryptography without encrypt_into
            return self.seal(wire.DATA, payload)
        size = len(payload) + TAG
        if self._data_buf is None or len(self._data_buf) < size:
            self._data_buf = _blank(size)
        out = self._data_buf[:size]
        head = wire.FRAME.pack(wire.DATA, size)
        with self._lock:
            n = self._next
            self._next += 1
        self._encrypt_into(_NONCE.pack(n), payload, head, out)
        return [memoryview(head), out]

    def send_nowait(
        self, sock: socket.socket, kind: int, payload: bytes = b"", field: int = 0
    ) -> None:
        """Seal and write one small frame without blocking (raises ``OSError``, e.g.
        ``BlockingIOError``). Numbers the frame only if some of it went out."""
        with self._lock:
            frame = b"".join(self._seal(self._next, kind, payload, field))
            sock.send(frame, _DONTWAIT)
            self._next += 1

    def send_instead_nowait(self, sock: socket.socket, kind: int, payload: bytes) -> None:
        """Like ``send_nowait``, but the frame takes the number of the last frame sealed,
        which the caller guarantees has not had a single byte written and never will (the
        engine's abort at a frame boundary: the queued frame is given up for the abort).
        Reusing its nonce is safe because that ciphertext never leaves this process."""
        with self._lock:
            n = max(0, self._next - 1)
            sock.send(b"".join(self._seal(n, kind, payload, 0)), _DONTWAIT)


class FrameOpener:
    """Reads and verifies the frames of one direction of one connection; ``recv_into`` and
    ``recv`` behave like a non-blocking socket's on the plaintext frame stream (see the module
    doc). Used by one thread at a time."""

    def __init__(self, sock: socket.socket, key: bytes, max_payload: int) -> None:
        self._sock = sock
        self._aead = new_aead(key)
        self._decrypt_into: Callable[..., Any] | None = getattr(self._aead, "decrypt_into", None)
        self._max_payload = max_payload
        self._next = 0
        self._head = bytearray(_HEAD)
        self._head_got = 0
        self._body: Any = None  # ciphertext + tag, allocated on first use
        self._body_len = -1
        """-1: reading a head; else bytes of ciphertext + tag of the current frame."""
        self._body_got = 0
        self._aad = b""
        self._out = memoryview(bytearray(_HEAD))  # the plaintext head handed out
        self._out_pos = _HEAD
        """Bytes of ``_out`` handed out; ``len(_out)``: nothing pending."""
        self._payload = 0
        """Plaintext payload bytes of the current frame not yet handed out."""
        self._plain: Any = None  # decrypted payload when the caller reads it piecewise
        self._plain_pos = -1
        """-1: the payload is still ciphertext."""
        self._failed: RemoteProtocolError | None = None

    # -- reading one frame's bytes off the socket ----------------------------------------
    def _fill(self, flags: int) -> bool:
        """Read towards the next complete frame; True once one is buffered. Returns False
        at EOF; raises ``BlockingIOError`` when the socket has no more for now."""
        sock = self._sock
        if self._body_len < 0:
            while self._head_got < _HEAD:
                mv = memoryview(self._head)[self._head_got :]
                n = sock.recv_into(mv, len(mv), flags)
                if n == 0:
                    return False
                self._head_got += n
            kind, length = wire.FRAME.unpack(self._head)
            if kind == wire.READY:
                body = TAG
            elif length < TAG:
                raise self._fail("malformed", f"sealed frame of {length} bytes")
            elif length - TAG > self._max_payload:
                raise self._fail(
                    "oversized",
                    f"frame of {length - TAG} bytes, above this member's limit of "
                    f"{self._max_payload} (do all members use the same chunk_bytes?)",
                )
            else:
                body = length
            if self._body is None or len(self._body) < body:
                self._body = _blank(max(body, 4096))
            self._body_len, self._body_got = body, 0
        while self._body_got < self._body_len:
            mv = self._body[self._body_got : self._body_len]
            n = sock.recv_into(mv, len(mv), flags)
            if n == 0:
                return False
            self._body_got += n
        return True

    def _fail(self, reason: str, detail: str) -> RemoteProtocolError:
        self._failed = RemoteProtocolError(reason, detail)
        return self._failed

    def _start_frame(self) -> None:
        """A frame is buffered: set up its plaintext head (and verify it now when it has no
        payload)."""
        kind, length = wire.FRAME.unpack(self._head)
        self._aad = bytes(self._head)
        self._head_got = 0
        self._body_len = -1
        payload = 0 if kind == wire.READY else length - TAG
        if payload == 0:
            self._open(self._out[:0])  # tag alone: verify before the head is used
        self._payload = payload
        self._plain_pos = -1
        wire.FRAME.pack_into(self._out, 0, kind, length if kind == wire.READY else payload)
        self._out_pos = 0

    def _open(self, dest: memoryview) -> None:
        """Decrypt the buffered frame into ``dest`` (exactly its payload size) and verify it."""
        from cryptography.exceptions import InvalidTag

        nonce = _NONCE.pack(self._next)
        sealed = self._body[: len(dest) + TAG]
        try:
            if self._decrypt_into is not None:
                self._decrypt_into(nonce, sealed, self._aad, dest)
            else:  # pragma: no cover - cryptography without decrypt_into
                dest[:] = self._aead.decrypt(nonce, bytes(sealed), self._aad)
        except InvalidTag:
            raise self._fail(
                "bad_mac", f"frame #{self._next} failed authentication (tampered or out of order)"
            ) from None
        self._next += 1

    # -- the socket-like interface ----------------------------------------------------------
    def recv_into(self, buf: memoryview, nbytes: int = 0, flags: int = 0) -> int:
        """Up to ``nbytes`` plaintext bytes into ``buf``: 0 at EOF, ``BlockingIOError`` when
        none are ready (``flags`` as for the socket, e.g. ``MSG_WAITALL`` to wait up to its
        timeout), ``RemoteProtocolError`` for a frame that fails authentication."""
        if self._failed is not None:
            raise self._failed
        mv = buf[: nbytes or len(buf)]
        if self._out_pos >= _HEAD and not self._payload:
            if not self._fill(flags):
                return 0
            self._start_frame()
        got = 0
        if self._out_pos < _HEAD:
            k = min(len(mv), _HEAD - self._out_pos)
            mv[:k] = self._out[self._out_pos : self._out_pos + k]
            self._out_pos += k
            got = k
            mv = mv[k:]
        if not self._payload or not len(mv) or self._out_pos < _HEAD:
            return got
        if self._plain_pos < 0 and len(mv) >= self._payload:
            self._open(mv[: self._payload])  # straight into place
            got += self._payload
            self._payload = 0
            return got
        if self._plain_pos < 0:
            if self._plain is None or len(self._plain) < self._payload:
                self._plain = _blank(max(self._payload, 4096))
            self._open(self._plain[: self._payload])
            self._plain_pos = 0
        k = min(len(mv), self._payload)
        mv[:k] = self._plain[self._plain_pos : self._plain_pos + k]
        self._plain_pos += k
        self._payload -= k
        return got + k

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        """Every plaintext byte ready now (at least ``bufsize`` is read if available, but a
        frame is never split: this may return more). b"" at EOF."""
        out = bytearray()
        while len(out) < bufsize or self._payload or self._out_pos < _HEAD:
            chunk = _blank(max(bufsize, self._payload + _HEAD))
            try:
                n = self.recv_into(chunk, len(chunk), flags)
            except BlockingIOError:
                if out:
                    break
                raise
            if n == 0:
                break
            out += chunk[:n]
        return bytes(out)


@dataclass
class RingCrypto:
    """The sealers and openers of one member's two ring connections."""

    fwd_tx: FrameSealer
    """Collective frames to the right neighbour (on ``Ring.send_sock``)."""
    rev_rx: FrameOpener
    """``READY`` frames and notices from the right neighbour (on ``Ring.send_sock``)."""
    fwd_rx: FrameOpener
    """Collective frames from the left neighbour (on ``Ring.recv_sock``)."""
    rev_tx: FrameSealer
    """``READY`` frames and notices to the left neighbour (on ``Ring.recv_sock``)."""

    @classmethod
    def create(
        cls,
        send_sock: socket.socket,
        send_keys: SessionKeys,
        recv_sock: socket.socket,
        recv_keys: SessionKeys,
        max_payload: int,
    ) -> RingCrypto:
        return cls(
            fwd_tx=FrameSealer(send_keys.forward),
            rev_rx=FrameOpener(send_sock, send_keys.reverse, wire.MAX_CONTROL_BYTES),
            fwd_rx=FrameOpener(recv_sock, recv_keys.forward, max_payload),
            rev_tx=FrameSealer(recv_keys.reverse),
        )
