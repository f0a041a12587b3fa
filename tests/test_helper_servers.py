"""The tests' loopback HTTP server: quiet when the client under test hangs up (what those tests
make it do), loud on any other error of a handler, as socketserver is."""
from http.server import BaseHTTPRequestHandler

import pytest

from helpers.httpserver import QuietOnHangUp


@pytest.fixture()
def server():
    httpd = QuietOnHangUp(("127.0.0.1", 0), BaseHTTPRequestHandler)
    yield httpd
    httpd.server_close()


def fail_in_handler(server, exc):
    """As socketserver's request thread does: the handler raised, handle_error runs in its except."""
    try:
        raise exc
    except Exception:
        server.handle_error(None, ("127.0.0.1", 40000))


@pytest.mark.parametrize("exc", [BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "reset by peer"),
                                 ConnectionAbortedError(103, "aborted")])
def test_a_client_hanging_up_prints_nothing(server, exc, capsys):
    fail_in_handler(server, exc)
    assert capsys.readouterr().err == ""


def test_any_other_error_of_a_handler_is_printed(server, capsys):
    fail_in_handler(server, ValueError("a bug in the handler"))
    err = capsys.readouterr().err
    assert "Exception occurred during processing of request from ('127.0.0.1', 40000)" in err
    assert "ValueError: a bug in the handler" in err
