"""Bounds on reading a request, for ``omrl env serve``: no client holds a connection for ever.

Left to itself uvicorn waits as long as a client likes for a request's headers and body: a body
shorter than its ``Content-Length`` held its connection open indefinitely (500 such connections
were held for at least 75 s in a hostile review). :func:`bounded_http` makes uvicorn's HTTP
protocol enforce two limits on every connection:

* ``read_timeout``: a request (headers and body) must arrive whole within this many seconds of
  its first byte (for a new connection, of the connection itself); past it the connection is
  closed. Time spent on the response, or idle between keep-alive requests (uvicorn's own
  ``timeout_keep_alive`` closes those), does not count.
* ``max_reading``: at most this many connections may be part-way through a request at once;
  one more closes the connection that has been reading longest. A client that sends its request
  at once leaves the reading state within a round trip, so a flood of slow clients cannot crowd
  out the next real one: the server answers it meanwhile.

Both are ``omrl env serve`` flags (``--read-timeout``, ``--max-reading``); see docs/reliability.md.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

READ_TIMEOUT = 10.0
MAX_READING = 64


def bounded_http(read_timeout: float = READ_TIMEOUT, max_reading: int = MAX_READING) -> type:
    """A uvicorn HTTP protocol class (``uvicorn.Config(http=...)``) enforcing both limits; the
    connections it counts are those of the servers that use this class."""
    if not read_timeout > 0 or max_reading < 1:
        raise ValueError(f"read_timeout must be > 0 and max_reading >= 1, got {read_timeout}, {max_reading}")
    import h11  # uvicorn's, with the serve extra
    from uvicorn.protocols.http.h11_impl import H11Protocol

    receiving = (h11.IDLE, h11.SEND_BODY)  # the client's states while a request is still arriving
    reading: OrderedDict[int, "BoundedH11"] = OrderedDict()  # oldest first

    class BoundedH11(H11Protocol):
        """uvicorn's h11 protocol, with a deadline on receiving each request and a cap on the
        connections receiving one."""

        limits = (read_timeout, max_reading)

        def connection_made(self, transport: Any) -> None:
            self.read_deadline: Any = None
            super().connection_made(transport)
            self.start_reading()

        def data_received(self, data: bytes) -> None:
            if self.read_deadline is None and self.conn.their_state is h11.IDLE:
                self.start_reading()  # the first bytes of the next keep-alive request
            super().data_received(data)
            if self.read_deadline is not None and self.conn.their_state not in receiving:
                self.stop_reading()  # the whole request is in

        def connection_lost(self, exc: Exception | None) -> None:
            self.stop_reading()
            super().connection_lost(exc)

        def start_reading(self) -> None:
            self.read_deadline = self.loop.call_later(read_timeout, self.drop)
            reading[id(self)] = self
            while len(reading) > max_reading:
                _, oldest = reading.popitem(last=False)
                oldest.drop()

        def stop_reading(self) -> None:
            if self.read_deadline is not None:
                self.read_deadline.cancel()
                self.read_deadline = None
            reading.pop(id(self), None)

        def drop(self) -> None:
            """Close a connection whose request did not arrive in time (or was evicted)."""
            self.stop_reading()
            if not self.transport.is_closing():
                self.transport.close()

    return BoundedH11
