"""Connecting the control channel while the model loads: rank 0 serves it,
the followers join it, and each starts watching the other (control.py holds
the channel itself)."""

from __future__ import annotations

import secrets
import threading

import mlx.core as mx

from ..errors import DistributedConfigError
from . import sharding
from .control import ControlClient, ControlServer, rank0_host
from .health import ABORT_GRACE, Health, ShardWorker, on_failure


def open_control(group, health: Health, thread: ShardWorker, opts) -> ControlServer | ControlClient:
    """Connect the control channel and start watching it: rank 0's monitor
    (a follower that exits or stops beating fails the load or the kit), a
    follower's heartbeats. Until it is up, a watchdog breaks the ring sockets
    after ``connect_timeout`` so that no collective waits forever on a stalled rank."""
    # accept() waits up to connect_timeout itself and reports who is missing; the
    # watchdog catches what it cannot (a collective around it that never returns).
    watchdog = threading.Timer(
        opts["connect_timeout"] + ABORT_GRACE,
        on_failure,
        (
            health,
            thread,
            f"a rank did not join the control channel within "
            f"{opts['connect_timeout']:g} s (connect_timeout): it is hung or stopped",
            None,
        ),
    )
    watchdog.daemon = True
    watchdog.start()
    try:
        if group.rank() == 0:
            control = _serve_control(group, opts)
            thread.watch_ring(lambda reason: on_failure(health, thread, reason, control))
            control.watch(lambda reason: on_failure(health, thread, reason, control))
        else:
            control = _join_control(group, opts)
            control.start(lambda: on_failure(health, thread, "rank 0 closed the control connection", None))
    finally:
        watchdog.cancel()
    return control


def _serve_control(group, opts) -> ControlServer:
    """Rank 0: open the control channel and wait for every follower to join."""
    error, server, token = None, None, secrets.randbits(62)
    try:
        host = opts["control_host"] or rank0_host()
        if not host:
            raise DistributedConfigError(
                "no ring hostfile (MLX_HOSTFILE) to find rank 0's address in; pass control_host"
            )
        server = ControlServer(host, group.size() - 1, token, opts["heartbeat_timeout"])
    except (OSError, ValueError) as exc:
        error = f"cannot open the control channel: {exc}"
    port = server.port if server else 0
    mx.eval(mx.distributed.all_sum(mx.array([port, token >> 31, token & (2**31 - 1)], dtype=mx.int32), group=group))
    if server is not None:
        try:
            server.accept(opts["connect_timeout"])
        except (OSError, ValueError) as exc:
            error = str(exc)
    sharding.agree(group, "connecting the control channel", error)
    return server


def _join_control(group, opts) -> ControlClient:
    """A follower: connect to rank 0's control channel."""
    port, high, low = mx.distributed.all_sum(mx.zeros((3,), dtype=mx.int32), group=group).tolist()
    error, client = None, None
    if port:
        try:
            host = opts["control_host"] or rank0_host() or ""
            client = ControlClient(host, port, (high << 31) | low, group.rank(), opts["connect_timeout"])
        except (OSError, ValueError) as exc:
            error = str(exc)
    else:
        error = "rank 0 opened no control channel"
    sharding.agree(group, "connecting the control channel", error)
    return client
