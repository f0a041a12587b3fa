"""Certificates, keys and CAs that the configuration names, loaded into an SSLContext through the
bounded reader: a regular file, never more than MAX_PEM_BYTES. OpenSSL opening the path itself
would block for ever on a FIFO (a `check-config` that never returns, a reload that holds the
daemon's main thread: #21 L3) and read a file of any size."""
from __future__ import annotations

import contextlib
import os
import re
import ssl
import tempfile
from collections.abc import Iterator

from .boundedio import read_head

MAX_PEM_BYTES = 1 << 20  # a CA bundle of a few hundred certificates; a chain and key are a few KiB
_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


def read_pem(path: str) -> bytes:
    """The file's bytes. Raises OSError (what the file was for is the caller's to say)."""
    data, more = read_head(os.path.expanduser(path), MAX_PEM_BYTES)
    if more:
        raise OSError(f"{path} is larger than {MAX_PEM_BYTES >> 20} MiB")
    return data


def load_ca(context: ssl.SSLContext, path: str) -> None:
    """Trust the certificates in `path` (PEM; DER when it has no PEM block)."""
    data = read_pem(path)
    blocks = _CERTIFICATE.findall(data)
    if blocks:  # text around the blocks (openssl's "subject=" lines) is not OpenSSL's to read here
        context.load_verify_locations(cadata=b"\n".join(blocks).decode("ascii", errors="replace"))
    else:
        context.load_verify_locations(cadata=data)


def load_cert_chain(context: ssl.SSLContext, cert_file: str, key_file: str) -> None:
    """load_cert_chain takes paths only: it is given an in-memory copy of what was read."""
    cert, key = read_pem(cert_file), read_pem(key_file)
    with _in_memory(cert) as cert_path, _in_memory(key) as key_path:
        context.load_cert_chain(cert_path, key_path)


def ca_context(path: str) -> ssl.SSLContext:
    """A client context that verifies servers against the CA in `path` only."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies certificate and host name; no CA yet
    load_ca(context, path)
    return context


@contextlib.contextmanager
def _in_memory(data: bytes) -> Iterator[str]:
    """A path to a private copy of `data`: a memfd (Linux), else a temporary file only we read."""
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create("gpumem-tls", os.MFD_CLOEXEC)
        try:
            os.write(fd, data)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.NamedTemporaryFile() as fh:  # created 0600
        fh.write(data)
        fh.flush()
        yield fh.name
