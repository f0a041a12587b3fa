"""Reading an HTTP response body from a server we do not control (vLLM, the kubelet): a hard
total deadline, so a server that drips one byte a second never holds sampling, and a size
bound counted after decompression, so neither a huge body nor a gzip bomb gets through."""
from __future__ import annotations

import time
from collections.abc import Callable

import urllib3
from urllib3.response import BaseHTTPResponse

# One read takes a whole vLLM page (about 50 KiB) where the socket has it; also caps what one
# gzip read may inflate to.
CHUNK_BYTES = 64 << 10


class BodyError(Exception):
    """kind: timeout | too_large | parse | truncated | connection; `cause` for connection."""

    def __init__(self, kind: str, detail: str, cause: BaseException | None = None):
        super().__init__(detail)
        self.kind, self.detail, self.cause = kind, detail, cause


def read_body(response: BaseHTTPResponse, max_bytes: int, deadline: float, timeout_seconds: float,
              clock: Callable[[], float] = time.monotonic) -> bytes:
    """The body of `response` (urllib3's, its content not preloaded), read by `deadline` (on
    `clock`)."""
    late = f"body not complete within {timeout_seconds:g}s"
    chunks: list[bytes] = []
    total = 0
    try:
        while True:
            remaining = deadline - clock()
            if remaining <= 0:
                raise BodyError("timeout", late)
            _limit_next_read(response, remaining)
            data = response.read1(CHUNK_BYTES, decode_content=True)
            if not data:
                return b"".join(chunks)
            total += len(data)
            if total > max_bytes:
                raise BodyError("too_large", f"response exceeds the {max_bytes}-byte limit")
            chunks.append(data)
    except BodyError:
        raise
    except (TimeoutError, urllib3.exceptions.TimeoutError):
        raise BodyError("timeout", late) from None
    except urllib3.exceptions.DecodeError:
        raise BodyError("parse", "body could not be decoded") from None
    except urllib3.exceptions.HTTPError as exc:
        raise BodyError("truncated", f"body ended early after {total} bytes ({type(exc).__name__})") from None
    except OSError as exc:
        raise BodyError("connection", str(exc), cause=exc) from None


def _limit_next_read(response: BaseHTTPResponse, seconds: float) -> None:
    """Shrink the socket timeout to what is left of the deadline, so a silent server cannot
    hold one read for the full per-read timeout. Best effort: urllib3 internals may differ."""
    sock = getattr(getattr(response, "connection", None), "sock", None)
    if sock is not None:
        try:
            sock.settimeout(max(seconds, 0.001))
        except OSError:
            pass
