"""Basic auth against bcrypt hashes, as Prometheus exporter-toolkit's `basic_auth_users`.

bcrypt is slow by design (tens of milliseconds at cost 10), which an unauthenticated client can
turn against the daemon. So:
- every check costs the same bcrypt work, that of the highest configured cost, whoever the user:
  an unknown user is checked against a placeholder hash of that cost, and a user whose hash has a
  lower cost gets padding checks that make up the difference (2^c + 2^c + 2^(c+1) + ... +
  2^(max-1) = 2^max rounds), so timing tells neither which users exist nor whose hash is cheap
  (#21 M2: 1.8 ms at cost 4 against 53 ms at cost 10). What is left is a few microseconds of
  overhead per bcrypt call;
- a credential that passed is remembered by a digest for `cache_seconds` after its last use (at
  most `cache_size` of them): a scraper pays bcrypt once, not on every scrape;
- at most `max_checks` bcrypt checks run at once; a request beyond that gets AuthBusy (503) at
  once instead of queueing, so wrong passwords never hold up a scraper whose credential is known.
"""
from __future__ import annotations

import base64
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import bcrypt

MAX_PASSWORD_BYTES = 72  # bcrypt's limit: longer ones are refused, as Go's bcrypt does


class AuthBusy(Exception):
    """Every bcrypt slot is taken: try again shortly."""


def bcrypt_cost(hashed: bytes) -> int:
    """The cost in `$2b$12$...` (4 to 31); 12 when unreadable (bcrypt then refuses the hash)."""
    try:
        return min(31, max(4, int(hashed.split(b"$")[2])))
    except (IndexError, ValueError):
        return 12


class BasicAuth:
    def __init__(self, users: dict[str, str], *, cache_seconds: float = 300.0, cache_size: int = 256,
                 max_checks: int = 2, now: Callable[[], float] = time.monotonic):
        self.users = {u: h.encode() for u, h in users.items()}
        self.cost = max((bcrypt_cost(h) for h in self.users.values()), default=10)
        self.placeholder_hash = bcrypt.hashpw(b"no such user", bcrypt.gensalt(self.cost))
        lowest = min((bcrypt_cost(h) for h in self.users.values()), default=self.cost)
        # One hash per cost below the highest that some user's hash has or pads up from (made
        # once: together they cost about one check at the highest cost).
        self._padding = {c: bcrypt.hashpw(b"padding", bcrypt.gensalt(c)) for c in range(lowest, self.cost)}
        self.cache_seconds = cache_seconds
        self.cache_size = cache_size
        self._now = now
        self._verified: OrderedDict[bytes, float] = OrderedDict()  # digest -> last use
        self._lock = threading.Lock()
        self._checks = threading.BoundedSemaphore(max_checks)

    def check(self, header: str | None) -> bool:
        """True for a configured user with the right password; AuthBusy when it cannot tell now."""
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:].strip(), validate=True).decode().partition(":")
        except ValueError:  # not base64 (binascii.Error), not ASCII (#21 L1: was a 500), not UTF-8
            return False
        secret = password.encode()
        if len(secret) > MAX_PASSWORD_BYTES:
            return False  # for every user alike, so it tells nothing
        hashed = self.users.get(user)
        digest = hashlib.sha256(b"\0".join((user.encode(), secret, hashed or b""))).digest()
        if hashed is not None and self._cached(digest):
            return True
        if not self._checks.acquire(blocking=False):
            raise AuthBusy()
        try:
            ok = self._verify(secret, hashed)
        finally:
            self._checks.release()
        if ok:
            with self._lock:
                self._verified[digest] = self._now()
                while len(self._verified) > self.cache_size:
                    self._verified.popitem(last=False)
        return ok

    def _verify(self, secret: bytes, hashed: bytes | None) -> bool:
        """bcrypt work of 2^cost rounds (the highest configured cost), whoever the user."""
        target = hashed or self.placeholder_hash
        try:
            ok = bcrypt.checkpw(secret, target) and hashed is not None
        except ValueError:  # a malformed hash in the web config
            ok = False
        for cost in range(bcrypt_cost(target), self.cost):
            bcrypt.checkpw(secret, self._padding[cost])
        return ok

    def _cached(self, digest: bytes) -> bool:
        with self._lock:
            last_use = self._verified.get(digest)
            if last_use is None:
                return False
            if self._now() - last_use > self.cache_seconds:
                del self._verified[digest]
                return False
            self._verified[digest] = self._now()
            self._verified.move_to_end(digest)
            return True
