"""The local stack's ports: each handed out once, free when handed out, and below the kernel's range
for outgoing connections, so none of the stack's own connections takes one before its component binds
it."""

from __future__ import annotations

import random
import socket

import pytest

from sharegpu.devcluster import controlplane


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    low = controlplane._ephemeral_low()
    ports = [controlplane.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports), "none handed out twice"
    assert all(1024 <= p < low for p in ports), (low, sorted(ports)[-3:])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[-1]))  # free when handed out: it binds


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        taken = int(held.getsockname()[1])
        offered: list[int] = []

        class TakenFirst:
            """Offers the port in use first, then any."""

            def randrange(self, start: int, stop: int) -> int:
                offered.append(taken if not offered else random.randrange(start, stop))
                return offered[-1]

        monkeypatch.setattr(controlplane, "_PICK", TakenFirst())
        monkeypatch.setattr(controlplane, "_ephemeral_low", lambda: 65536)
        port = controlplane.free_port()
    assert offered[0] == taken and port != taken and port == offered[-1]
