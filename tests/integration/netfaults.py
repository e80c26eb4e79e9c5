"""A real network blip for the tests: a TCP proxy in front of a server that can go down and up.

:class:`FlakyProxy` listens on 127.0.0.1 and relays every connection to the server behind it.
``down()`` closes its port (new connections are refused) and cuts the connections open through
it, as a restarting load balancer or a network that drops out does; ``up()`` listens on the same
port again. The server behind it (moto) keeps its state, so a run pointed at the proxy meets a
real outage of a few seconds and then finds its bucket as it left it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

from tests.integration.servers import free_port


class FlakyProxy:
    """A TCP relay from ``127.0.0.1:port`` to ``127.0.0.1:target_port`` (see module doc)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._serving = threading.Event()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        """Accept connections (again) on :attr:`port`."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.05)
        self._listener = listener
        self._serving.set()
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        """Refuse new connections and cut the open ones."""
        self._serving.clear()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            conns, self._open = self._open, set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def _accept(self, listener: socket.socket) -> None:
        while self._serving.is_set() and listener is self._listener:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def flaky_proxy(target_port: int) -> Iterator[FlakyProxy]:
    """A :class:`FlakyProxy` serving while the block runs."""
    proxy = FlakyProxy(target_port)
    proxy.up()
    try:
        yield proxy
    finally:
        proxy.down()
