"""A loopback HTTP server for tests whose client under test hangs up on purpose."""
from __future__ import annotations

import sys
from http.server import ThreadingHTTPServer
from typing import Any

# The client went away mid-exchange: it cut a read short at its budget, gave up at its deadline,
# or reset the connection. A test that makes it do so expects this.
HANG_UPS = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class QuietOnHangUp(ThreadingHTTPServer):
    """ThreadingHTTPServer that says nothing when the client hangs up, and prints every other
    error of a handler as socketserver does. A handler writing after its test ended (a slow
    route released at teardown) otherwise printed its traceback into the suite's output."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], HANG_UPS):
            return
        super().handle_error(request, client_address)
