"""The configuration reload (SIGHUP) as an object: re-read the file, apply what it says to the
running daemon, or keep the running configuration and say why. The daemon never dies of one.

`request()` is what the signal handler calls. A signal that arrives while a reload runs (Python
runs handlers between two bytecodes of the main thread, so the handler can be re-entered) does
not start a second one alongside: the running reload goes round once more when it is done, so
the file's last version is always the one applied. What a reload cannot change (the keys the
schema marks RESTART) is named in the log when it changes. `stats` says whether the last load
worked and when one last did, for `gpumem_exporter_config_last_reload_*`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from .config import Config, ConfigError
from .config.fields import restart_keys
from .model import ReloadStats

log = logging.getLogger("exporter.reload")

RESTART_KEYS = restart_keys(Config)


def _value(config: Config, key: str) -> object:
    for part in key.split("."):
        config = getattr(config, part)
    return config


def restart_only_changes(old: Config, new: Config) -> list[str]:
    """The keys marked RESTART whose value differs between `old` and `new`."""
    return [key for key in RESTART_KEYS if _value(old, key) != _value(new, key)]


class Reloader:
    """`load()` reads and checks the file (raises ConfigError); `apply(config)` makes the daemon
    use it from its next tick (raises on any failure, leaving the running one in place)."""

    def __init__(self, config: Config, load: Callable[[], Config], apply: Callable[[Config], None],
                 now: Callable[[], float], where: str = ""):
        self.config = config  # the running configuration
        self._load = load
        self._apply = apply
        self._now = now
        self._where = f" in {where}" if where else ""
        self._busy = False
        self._again = False
        self.stats = ReloadStats(successful=True, last_success_at=now())  # the start was a successful load

    def request(self, *_: object) -> None:
        """Reload now, or once more after the reload in progress (a signal handler's signature)."""
        if self._busy:
            self._again = True
            return
        self._busy = True
        try:
            while True:
                self._again = False
                self.reload_once()
                if not self._again:
                    break
        finally:
            self._busy = False

    def reload_once(self) -> bool:
        """One reload: True when the new configuration is in use."""
        try:
            new = self._load()
            self._apply(new)
        except ConfigError as exc:  # one log line, every problem in it
            log.error("reload failed, keeping the running configuration: invalid configuration%s: %s",
                      self._where, "; ".join(" ".join(p.split()) for p in exc.problems))
            return self._failed()
        except Exception as exc:  # building sources can fail in ways no check foresees
            log.error("reload failed, keeping the running configuration: %s: %s", type(exc).__name__, exc,
                      exc_info=log.isEnabledFor(logging.DEBUG))
            return self._failed()
        changed = restart_only_changes(self.config, new)
        self.config = new
        self.stats = ReloadStats(successful=True, last_success_at=self._now())
        if changed:
            log.warning("changed settings that take effect only on restart: %s", ", ".join(changed))
        log.info("configuration reloaded")
        return True

    def _failed(self) -> bool:
        self.stats = ReloadStats(successful=False, last_success_at=self.stats.last_success_at)
        return False
