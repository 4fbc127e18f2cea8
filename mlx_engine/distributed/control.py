"""The control channel: a TCP connection from each follower to rank 0, beside
MLX's own, that says whether the ranks are alive.

MLX's ring backend raises ``RuntimeError("[ring] connection to a peer was
lost")`` within about a second when a peer process dies, but waits forever on a
peer that is alive and silent (stopped, swapping, deadlocked). So each follower
sends a heartbeat every ``HEARTBEAT_INTERVAL`` seconds from a thread of its own;
rank 0's monitor declares a rank failed when its connection closes or its
heartbeats stop for ``heartbeat_timeout`` seconds. Then the collectives blocked on
that rank are released by shutting down this process's ring sockets
(``break_ring_sockets``), which makes MLX fail them with its "connection lost"
error. Followers watch the same connection: when rank 0 closes it (it died, or
gave up on the job) they break their own ring sockets and stop serving.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import stat
import struct
import threading
import time
from typing import Callable

from ..errors import DistributedConfigError

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 0.5
_HELLO = struct.Struct("!QI")  # token, rank


class ControlServer:
    """Rank 0's end: accepts one connection per follower, then watches them."""

    def __init__(self, host: str, followers: int, token: int, heartbeat_timeout: float):
        self.followers = followers
        self.token = token
        self.heartbeat_timeout = heartbeat_timeout
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._conns: dict[int, socket.socket] = {}
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def accept(self, timeout: float) -> None:
        """Wait for every follower's hello (refusing strangers) for at most ``timeout`` s."""
        deadline = time.monotonic() + timeout
        try:
            while len(self._conns) < self.followers:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, self.followers + 1)) - set(self._conns))
                    raise DistributedConfigError(
                        f"ranks {missing} did not connect to rank 0's control channel within {timeout:.0f} s"
                    )
                self._listener.settimeout(left)
                try:
                    conn, _ = self._listener.accept()
                except socket.timeout:
                    continue
                self._admit(conn)
        finally:
            self._listener.close()

    def _admit(self, conn: socket.socket) -> None:
        """Keep ``conn`` if it says hello with the job's token and a rank not yet connected."""
        conn.settimeout(5.0)
        try:
            token, rank = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
        except (OSError, ConnectionError):
            conn.close()
            return
        if token != self.token or not 1 <= rank <= self.followers or rank in self._conns:
            conn.close()
            return
        conn.settimeout(None)
        self._conns[rank] = conn

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Start the monitor thread; ``on_failure(reason)`` is called once."""
        self._thread = threading.Thread(
            target=self._monitor, args=(on_failure,), name="mlx-engine-shard-monitor", daemon=True
        )
        self._thread.start()

    def _monitor(self, on_failure: Callable[[str], None]) -> None:
        last = {rank: time.monotonic() for rank in self._conns}
        by_sock = {conn: rank for rank, conn in self._conns.items()}
        while not self._closed.is_set():
            try:
                ready, _, _ = select.select(list(by_sock), [], [], HEARTBEAT_INTERVAL)
            except (OSError, ValueError):  # closed under us
                return
            now = time.monotonic()
            for conn in ready:
                rank = by_sock[conn]
                try:
                    data = conn.recv(64)
                except OSError:
                    data = b""
                if not data:
                    return self._fail(
                        on_failure, f"rank {rank}'s process exited or was killed (its control connection closed)"
                    )
                last[rank] = now
            for rank, seen in last.items():
                if now - seen > self.heartbeat_timeout:
                    return self._fail(
                        on_failure, f"rank {rank} sent no heartbeat for {now - seen:.1f} s: it is hung or stopped"
                    )

    def closing(self) -> None:
        """Rank 0 is releasing the followers: their connections closing is expected."""
        self._closed.set()

    def _fail(self, on_failure: Callable[[str], None], reason: str) -> None:
        if not self._closed.is_set():
            logger.error("sharded kit: %s", reason)
            on_failure(reason)
            self.close()

    def close(self) -> None:
        """Close every connection: the followers stop serving."""
        self._closed.set()
        for conn in self._conns.values():
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        try:
            self._listener.close()
        except OSError:
            pass


class ControlClient:
    """A follower's end: heartbeats to rank 0, and notice when rank 0 goes away."""

    def __init__(self, host: str, port: int, token: int, rank: int, timeout: float):
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise DistributedConfigError(
                f"rank {rank} could not reach rank 0's control channel at {host}:{port}: {exc}"
            ) from exc
        self._sock.sendall(_HELLO.pack(token, rank))
        self._sock.settimeout(None)
        self._closed = threading.Event()

    def start(self, on_lost: Callable[[], None]) -> None:
        """Heartbeat and watch from now on; ``on_lost`` (until ``redirect``)
        runs if rank 0 goes away."""
        self.on_lost = on_lost
        threading.Thread(target=self._beat, name="mlx-engine-heartbeat", daemon=True).start()
        threading.Thread(target=self._watch, name="mlx-engine-control", daemon=True).start()

    def redirect(self, on_lost: Callable[[], None]) -> None:
        """Run ``on_lost`` instead if rank 0 goes away (read when the connection is lost)."""
        self.on_lost = on_lost

    def _beat(self) -> None:
        while not self._closed.wait(HEARTBEAT_INTERVAL):
            try:
                self._sock.sendall(b"h")
            except OSError:
                return

    def _watch(self) -> None:
        try:
            while self._sock.recv(64):
                pass
        except OSError:
            pass
        if not self._closed.is_set():
            self.on_lost()

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed during hello")
        data += chunk
    return data


def ring_addresses() -> set[tuple[str, int]]:
    """Every ``ip:port`` of the ring backend's hostfile (``MLX_HOSTFILE``)."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        return set()
    try:
        with open(path, encoding="utf-8") as f:
            hosts = json.load(f)
    except (OSError, ValueError):
        return set()
    out = set()
    for entry in hosts if isinstance(hosts, list) else []:
        for addr in entry if isinstance(entry, list) else []:
            host, _, port = str(addr).rpartition(":")
            if port.isdigit():
                out.add((host, int(port)))
    return out


def rank0_host() -> str | None:
    """Rank 0's IP from the ring hostfile (``MLX_HOSTFILE``), if there is one."""
    path = os.environ.get("MLX_HOSTFILE")
    try:
        with open(path or "", encoding="utf-8") as f:
            hosts = json.load(f)
        first = hosts[0][0] if isinstance(hosts[0], list) else hosts[0]["ips"][0]
        return str(first).rpartition(":")[0] or str(first)
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return None


def break_ring_sockets() -> int:
    """Shut down this process's TCP sockets to or from the ring hostfile's
    addresses, so that MLX's collectives blocked on a hung peer fail with its
    "connection lost" error instead of waiting forever. Returns how many were
    shut down. Only sockets whose local or peer address is in the hostfile are
    touched; the process's other sockets are left alone."""
    addresses = ring_addresses()
    if not addresses:
        return 0
    count = 0
    fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    for name in os.listdir(fd_dir):
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
        except (ValueError, OSError):
            continue
        try:
            ends = [_address(sock.getsockname)]
            ends.append(_address(sock.getpeername))
            if any(end in addresses for end in ends if end):
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return count


def _address(get) -> tuple[str, int] | None:
    try:
        addr = get()
    except OSError:
        return None
    return (addr[0], addr[1]) if isinstance(addr, tuple) and len(addr) >= 2 else None
