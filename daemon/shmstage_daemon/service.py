"""shmstaged as a service: systemd notifications, signals, reloads and the metrics endpoint.

The Daemon serves trainers; this wraps it with what a service manager and an operator need,
all on the daemon's own event loop:

- READY=1 once the socket is served; STATUS= whenever the one-line summary changes;
  STOPPING=1 as soon as a stop is requested (draining can take a while).
- WATCHDOG=1 from the event loop itself, so a loop stuck in a blocking call stops pinging
  and systemd restarts the daemon.
- SIGHUP re-reads the configuration in an I/O thread (user and group lookups can block on
  NSS), then applies it in the loop: RELOADING=1 … READY=1. A bad file is logged with
  every problem and the running configuration stays.
- An optional Prometheus endpoint on 127.0.0.1:<metrics_port> (any local user can read it)
  and/or on a unix socket, ``metrics_socket``, mode 0660: only the daemon's user and group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Final

from shmstage.metrics import render
from shmstage_daemon import logsetup
from shmstage_daemon.config import Config, ConfigError
from shmstage_daemon.notify import Notifier, watchdog_loop
from shmstage_daemon.server import Daemon, Settings

log = logging.getLogger("shmstaged")

STATUS_INTERVAL_S: Final = 2.0
_HTTP_READ_TIMEOUT_S: Final = 5.0
_HTTP_MAX_HEADER_BYTES: Final = 16 * 1024


class EarlySignals:
    """Signals that arrive while the daemon starts, before its event loop handles them.

    Start-up (journal adoption, reaping, binding) runs before the loop, and a
    ``systemctl stop`` or Ctrl-C can land there: with Python's defaults a SIGINT raises
    wherever start-up happens to be, and a SIGHUP kills the process. Installed first
    thing, this only notes them; ``Service.run`` acts on them once it can stop cleanly.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._note)

    def _note(self, signum: int, _frame: object) -> None:
        self.received.append(signum)


class Service:
    def __init__(
        self,
        daemon: Daemon,
        notifier: Notifier,
        config: Config,
        load: Callable[[], Config],
        to_settings: Callable[[Config], Settings],
        early: EarlySignals | None = None,
    ) -> None:
        self.early = early
        self.daemon = daemon
        self.notifier = notifier
        self.config = config
        self._load = load
        self._to_settings = to_settings
        self._tasks: list[asyncio.Task[None]] = []
        self._reloading: asyncio.Task[None] | None = None
        self._metrics_server: asyncio.Server | None = None
        self._metrics_unix: asyncio.Server | None = None
        self._last_status = ""

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stop)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        if self.early is not None and self.early.received:
            log.info("acting on signal(s) received while starting: %s", self.early.received)
            if signal.SIGHUP in self.early.received:
                self.request_reload()
            if {signal.SIGTERM, signal.SIGINT} & set(self.early.received):
                self.stop()
        interval = self.notifier.watchdog_interval()
        if interval is not None:
            self._tasks.append(loop.create_task(watchdog_loop(self.notifier, interval)))
            log.info("systemd watchdog: pinging every %.1f s", interval)
        if self.config.metrics_port is not None:
            await self._start_metrics(self.config.metrics_port)
        if self.config.metrics_socket is not None:
            await self._start_metrics_socket(self.config.metrics_socket)
        serving = loop.create_task(self.daemon.serve())
        self._last_status = self.daemon.status.status_line()
        self.notifier.ready(self._last_status)
        # Start-up logged "listening on" before the loop existed; from here signals, the
        # loop's own descriptors and every connection are handled (tests wait for this).
        log.info("ready: serving %s", self.daemon.settings.socket_path)
        self._tasks.append(loop.create_task(self._status_loop()))
        try:
            await serving
        finally:
            for task in self._tasks:
                task.cancel()
            if self._metrics_server is not None:
                self._metrics_server.close()
            if self._metrics_unix is not None:
                self._metrics_unix.close()
                with contextlib.suppress(OSError):
                    os.unlink(self.config.metrics_socket)
            self.notifier.close()
        return 0

    def stop(self) -> None:
        if not self.daemon.stopping:
            jobs = len(self.daemon.jobs)
            self.notifier.stopping(f"stopping: finishing {jobs} checkpoint(s) being written")
        self.daemon.request_stop()

    async def _status_loop(self) -> None:
        while True:
            await asyncio.sleep(STATUS_INTERVAL_S)
            line = self.daemon.status.status_line()
            if line != self._last_status and not self.daemon.stopping:
                self._last_status = line
                self.notifier.status(line)

    # -- reload ------------------------------------------------------------------

    def request_reload(self) -> None:
        if self._reloading is not None and not self._reloading.done():
            log.info("SIGHUP while a reload is running; ignored")
            return
        self._reloading = asyncio.get_running_loop().create_task(self.reload())

    async def reload(self) -> None:
        if self.daemon.stopping:
            return
        self.notifier.reloading("reloading configuration")
        where = self.config.source or "built-in defaults"
        log.info("SIGHUP: reloading configuration from %s", where)
        try:
            new = await self.daemon.run_io(self._load)
        except ConfigError as exc:
            for problem in exc.problems:
                log.error("reload: %s", problem)
            log.error("configuration NOT reloaded; the running configuration stays in force")
            self.notifier.ready(f"reload failed, old configuration kept; {self._status()}")
            return
        except Exception:
            log.exception("reload failed; the running configuration stays in force")
            self.notifier.ready(f"reload failed, old configuration kept; {self._status()}")
            return
        for warning in new.warnings:
            log.warning("%s", warning)
        changes = self.config.diff(new)
        needs_restart = self.daemon.reconfigure(self._to_settings(new))
        logsetup.configure(new.log_level, new.log_format)
        if new.metrics_port != self.config.metrics_port:
            await self._restart_metrics(new.metrics_port)
        self.config = new
        for name, (before, after) in sorted(changes.items()):
            log.info("reload: %s %s -> %s", name, _show(before), _show(after))
        for name in needs_restart:
            log.warning("reload: %s changed; it takes effect when shmstaged restarts", name)
        log.info("configuration reloaded (%d setting(s) changed)", len(changes))
        self.notifier.ready(self._status())

    def _status(self) -> str:
        self._last_status = self.daemon.status.status_line()
        return self._last_status

    # -- metrics over HTTP -------------------------------------------------------

    async def _start_metrics(self, port: int) -> None:
        try:
            self._metrics_server = await asyncio.start_server(self._serve_http, "127.0.0.1", port)
        except OSError as exc:
            # Metrics are an aid, not the service: keep staging checkpoints without them.
            log.error("metrics: cannot listen on 127.0.0.1:%d (%s); no HTTP metrics", port, exc)
            return
        log.info("metrics: serving http://127.0.0.1:%d/metrics", port)

    async def _start_metrics_socket(self, path: Path) -> None:
        """The same endpoint on a unix socket only the daemon's user and group can open:
        for nodes where even aggregate counters are not for every local user."""
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)  # left by an earlier run; anything else is refused below
        old_umask = os.umask(0o117)  # created 0660, never wider for a moment
        try:
            self._metrics_unix = await asyncio.start_unix_server(self._serve_http, str(path))
        except OSError as exc:
            log.error("metrics: cannot listen on %s (%s); no metrics there", path, exc)
            return
        finally:
            os.umask(old_umask)
        log.info("metrics: serving on the unix socket %s (mode 0660)", path)

    async def _restart_metrics(self, port: int | None) -> None:
        if self._metrics_server is not None:
            self._metrics_server.close()
            await self._metrics_server.wait_closed()
            self._metrics_server = None
        if port is not None:
            await self._start_metrics(port)

    async def _serve_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Just enough HTTP/1.0 for a Prometheus scrape: GET /metrics, one response, close."""
        try:
            head = await asyncio.wait_for(
                reader.readuntil(b"\r\n\r\n"), timeout=_HTTP_READ_TIMEOUT_S
            )
            if len(head) > _HTTP_MAX_HEADER_BYTES:
                raise ValueError("header too large")
            method, target, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            if method != "GET":
                status, body, ctype = "405 Method Not Allowed", "GET only\n", "text/plain"
            elif target.split("?", 1)[0] not in ("/metrics", "/"):
                status, body, ctype = "404 Not Found", "see /metrics\n", "text/plain"
            else:
                status, body = "200 OK", render(self.daemon.status.metrics())
                ctype = "text/plain; version=0.0.4; charset=utf-8"
            data = body.encode()
            writer.write(
                f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data
            )
            await asyncio.wait_for(writer.drain(), timeout=_HTTP_READ_TIMEOUT_S)
        except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError,
                asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def _show(value: object) -> str:
    if isinstance(value, frozenset | set):
        return str(sorted(value))
    return str(value)
