"""Who may hold one of the listener's connections: bookkeeping only, no sockets (server.py does
the I/O and asks here at every accept).

Budgets, each a count (what each costs in memory is in docs/architecture.md):
- `max_connections` open connections in all, and `max_per_peer` from one peer (an IPv4
  address, or an IPv6 /64, which one host usually holds whole);
- TLS: `max_handshakes` unfinished handshakes in all, `max_handshakes_per_peer` from one peer.
  A handshake costs far more than a connection that finished it, so its budget is much smaller.

A peer at one of its own limits has its new connection refused at once: it never displaces
another's, nor one of its own still in use (only one already answered, lingering for its
client's close), since every displaced connection comes straight back as a reconnect, and a
flood of those is what starved scrapers (#21 M1). At a total, a newcomer takes
the place of, first, any connection already answered (it only lingers for its client's close),
else the oldest connection still waiting on its client of the peer that holds the most, provided
that peer holds at least two more than the newcomer's: so one peer never crowds out another, and
two peers can never displace each other back and forth.
"""
from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Callable

# A slot's states, in order. Every state but ANSWER waits on the client (or on nobody) and may
# be displaced; ANSWER holds a worker thread and is never cut short.
HANDSHAKE, HEAD, ANSWER, WRITE, LINGER = "handshake", "head", "answer", "write", "linger"

# The limits a new connection can be refused by (the `reason` of gpumem_exporter_listener_refused_total).
PEER_CONNECTIONS, PEER_HANDSHAKES, CONNECTIONS, HANDSHAKES = LIMITS = (
    "peer_connections", "peer_handshakes", "connections", "handshakes")


def peer_of(address: str) -> str:
    """The peer a connection counts against: an IPv4 address (IPv4-mapped IPv6 included), or an
    IPv6 address's /64."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class Slot:
    """One admitted connection. `evict` is what displacing it does (the server sets it)."""

    __slots__ = ("evict", "peer", "state")

    def __init__(self, peer: str, state: str):
        self.peer, self.state = peer, state
        self.evict: Callable[[], object] = lambda: None


class Admission:
    def __init__(self, max_connections: int, max_per_peer: int, max_handshakes: int,
                 max_handshakes_per_peer: int):
        if min(max_connections, max_per_peer, max_handshakes, max_handshakes_per_peer) < 1:
            raise ValueError("connection limits must be at least 1")
        self.max_connections, self.max_per_peer = max_connections, max_per_peer
        self.max_handshakes, self.max_handshakes_per_peer = max_handshakes, max_handshakes_per_peer
        self._by_peer: dict[str, dict[Slot, None]] = {}  # each peer's slots, oldest first
        self._lingering: dict[Slot, None] = {}  # answered ones, oldest first
        self._handshakes: Counter[str] = Counter()
        self.open = 0
        # Connections closed at once, by the limit that refused them, and connections displaced:
        # exported (gpumem_exporter_listener_*_total), read by tests and benchmarks.
        self.refused_by: Counter[str] = Counter()
        self.evicted = 0

    @property
    def refused(self) -> int:
        return sum(self.refused_by.values())

    @property
    def handshakes(self) -> int:
        return sum(self._handshakes.values())

    def admit(self, peer: str, tls: bool) -> Slot | None:
        """A slot for a new connection from `peer` (displacing another if the rules allow), or
        None: close it at once."""
        held = len(self._by_peer.get(peer, ()))
        if held >= self.max_per_peer and not self._end_lingering(peer):
            self.refused_by[PEER_CONNECTIONS] += 1
            return None
        if tls and self._handshakes[peer] >= self.max_handshakes_per_peer:
            self.refused_by[PEER_HANDSHAKES] += 1
            return None
        if self.open >= self.max_connections and not self._make_room_for(peer):
            self.refused_by[CONNECTIONS] += 1
            return None
        if tls and self.handshakes >= self.max_handshakes and not self._make_handshake_room_for(peer):
            self.refused_by[HANDSHAKES] += 1
            return None
        slot = Slot(peer, HANDSHAKE if tls else HEAD)
        self._by_peer.setdefault(peer, {})[slot] = None
        self.open += 1
        if tls:
            self._handshakes[peer] += 1
        return slot

    def move(self, slot: Slot, state: str) -> None:
        """The connection goes on to `state` (nothing if it was displaced meanwhile)."""
        if slot not in self._by_peer.get(slot.peer, ()):
            return
        if slot.state == HANDSHAKE:
            _uncount(self._handshakes, slot.peer)
        if state == LINGER:
            self._lingering[slot] = None
        slot.state = state

    def release(self, slot: Slot) -> None:
        """The connection is closed (idempotent)."""
        slots = self._by_peer.get(slot.peer)
        if slots is None or slot not in slots:
            return
        del slots[slot]
        if not slots:
            del self._by_peer[slot.peer]
        self.open -= 1
        self._lingering.pop(slot, None)
        if slot.state == HANDSHAKE:
            _uncount(self._handshakes, slot.peer)

    def _end_lingering(self, peer: str) -> bool:
        """Displace the peer's own oldest answered connection, if it has one."""
        lingering = next((s for s in self._lingering if s.peer == peer), None)
        if lingering is None:
            return False
        self._evict(lingering)
        return True

    def _make_room_for(self, peer: str) -> bool:
        if self._lingering:
            self._evict(next(iter(self._lingering)))
            return True
        counts = Counter({p: len(slots) for p, slots in self._by_peer.items()})
        return self._displace(peer, counts, _WAITING)

    def _make_handshake_room_for(self, peer: str) -> bool:
        return self._displace(peer, self._handshakes, (HANDSHAKE,))

    def _displace(self, peer: str, counts: Counter[str], states: tuple[str, ...]) -> bool:
        """Evict the oldest slot in `states` of the peer holding the most (by `counts`), if it
        holds at least two more than `peer`; peers with no such slot are passed over."""
        for victim_peer, held in counts.most_common():
            if held < counts[peer] + 2:
                return False
            victim = next((s for s in self._by_peer[victim_peer] if s.state in states), None)
            if victim is not None:
                self._evict(victim)
                return True
        return False

    def _evict(self, slot: Slot) -> None:
        self.release(slot)
        self.evicted += 1
        slot.evict()


def _uncount(counts: Counter[str], peer: str) -> None:
    counts[peer] -= 1
    if counts[peer] <= 0:
        del counts[peer]


_WAITING = (HANDSHAKE, HEAD, WRITE, LINGER)
