"""What the history's raw frames show of rare events, kept as the frames come and go, so a
detector that asks every tick "did it happen within my window?" reads the frames only when it
did (History owns one and answers through it; bench/overhead.py: each of these reads was a full
pass over an hour of frames every tick).

- the vLLM servers' sleep states: (endpoint, state) -> the times of the frames showing it;
- serving processes (role "vllm"): when each was last seen on each GPU;
- each engine's preemptions counter: the value it has held, and since when;
- each engine's KV cache usage: a falling run of peaks (each the highest since its time).

An answer may count a frame since thinned (a peak, a serving process): it can only send a
detector back to the frames, never keep it from an event, so verdicts are those of a full read.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from ..model import Identity, Snapshot
from .sleep_state import sleep_state

Engine = tuple[str, str, str]  # (endpoint, model, engine)


class FrameIndex:
    def __init__(self) -> None:
        self._frame_states: deque[tuple[tuple[str, str], ...]] = deque()  # beside the frames, in order
        self._state_times: dict[tuple[str, str], deque[float]] = {}
        # Least recently seen first; let go of once older than the oldest frame.
        self._serving_seen: OrderedDict[tuple[str, Identity], float] = OrderedDict()
        # engine -> (preemptions_total, since, last seen): the value every frame since `since`
        # gave it (a frame where it is unknown aside).
        self._preemption_runs: dict[Engine, tuple[float, float, float]] = {}
        # engine -> (time, usage), usage falling from first to last: each the peak since its time.
        self._kv_peaks: dict[Engine, deque[tuple[float, float]]] = {}

    # --- writing: History calls these as it keeps and lets go of frames -----------------
    def add(self, snapshot: Snapshot) -> None:
        """A frame kept (the newest)."""
        t = snapshot.timestamp
        for gpu in snapshot.gpus:
            for p in gpu.processes:
                if p.role == "vllm":
                    key = (gpu.uuid, p.identity)
                    self._serving_seen[key] = t
                    self._serving_seen.move_to_end(key)
        for server in snapshot.vllm:
            if not server.up:
                continue
            for e in server.engines:
                engine = (server.endpoint, e.model, e.engine)
                if e.preemptions_total is not None:
                    run = self._preemption_runs.get(engine)
                    since = run[1] if run is not None and run[0] == e.preemptions_total else t
                    self._preemption_runs[engine] = (e.preemptions_total, since, t)
                if e.kv_cache_usage_ratio is not None:
                    peaks = self._kv_peaks.setdefault(engine, deque())
                    while peaks and peaks[-1][1] <= e.kv_cache_usage_ratio:
                        peaks.pop()
                    peaks.append((t, e.kv_cache_usage_ratio))
        states = tuple({v.endpoint: sleep_state(v) for v in snapshot.vllm}.items())
        self._frame_states.append(states)
        for state in states:
            self._state_times.setdefault(state, deque()).append(t)

    def drop(self, newest: bool) -> None:
        """A frame let go of: the oldest (its times are the first of theirs), or the newest
        (thinned)."""
        states = self._frame_states.pop() if newest else self._frame_states.popleft()
        for key in states:
            times = self._state_times[key]
            times.pop() if newest else times.popleft()
            if not times:
                del self._state_times[key]

    def trim(self, oldest: float, sweep: bool) -> None:
        """Forget what no frame kept (the oldest at `oldest`) shows; the engines' entries only on
        a `sweep` (once a bucket: they are few, and only ever over-count)."""
        seen = self._serving_seen
        while seen and next(iter(seen.values())) < oldest:
            seen.popitem(last=False)
        if not sweep:
            return
        for engine in [k for k, run in self._preemption_runs.items() if run[2] < oldest]:
            del self._preemption_runs[engine]
        for engine, peaks in list(self._kv_peaks.items()):
            while peaks and peaks[0][0] < oldest:
                peaks.popleft()
            if not peaks:
                del self._kv_peaks[engine]

    # --- reading --------------------------------------------------------------------------
    def serving_seen(self, since: float) -> list[tuple[str, Identity]]:
        out = []
        for key, seen in reversed(self._serving_seen.items()):
            if seen < since:
                break
            out.append(key)
        return out

    def preemptions_run(self, engine: Engine) -> tuple[float, float] | None:
        run = self._preemption_runs.get(engine)
        return None if run is None else (run[0], run[1])

    def kv_usage_peak(self, engine: Engine, since: float) -> float | None:
        for t, usage in self._kv_peaks.get(engine, ()):
            if t >= since:
                return usage
        return None

    def sleep_states(self, since: float, before: float) -> dict[str, frozenset[str]]:
        out: dict[str, set[str]] = {}
        for (endpoint, state), times in self._state_times.items():
            # The newest such frame before `before`: the last, or the one before it (the frames
            # at or after `before` are the current tick's, at most one or two).
            i = len(times) - 1
            while i >= 0 and times[i] >= before:
                i -= 1
            if i >= 0 and times[i] >= since:
                out.setdefault(endpoint, set()).add(state)
        return {endpoint: frozenset(states) for endpoint, states in out.items()}
