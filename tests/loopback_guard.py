"""Tests talk to loopback only; this module makes sure of it. Imported once (tests.conftest is also
imported by test modules, as a second module: installing twice would wrap the wrappers).

Every process a test starts (the agentrl command, Ray's processes, Chromium) inherits the proxy
settings below: an HTTP request to anywhere else goes to a loopback port where nothing listens and
fails at once, without a DNS lookup. Ray's dashboard process, for one, asks the cloud metadata
address (169.254.169.254) which cloud it runs on, usage statistics off or not. In the pytest
process, a lookup or a connection beyond loopback fails before any packet is sent and is recorded,
so that the test that tried fails too (conftest's `loopback_only`), even where a library swallows
the error (a telemetry ping).
"""

from __future__ import annotations

import ipaddress
import os
import socket

NOWHERE = "http://127.0.0.1:9"
for _key in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
    os.environ[_key] = os.environ[_key.lower()] = NOWHERE
os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost,::1"

BEYOND_LOOPBACK: list[str] = []  # what this process tried to resolve or reach elsewhere


def is_local(host: object) -> bool:
    """A loopback name or address, or none (a bind to every interface sends nothing)."""
    if host is None:
        return True
    host = (host.decode() if isinstance(host, bytes) else str(host)).strip("[]").split("%")[0]
    if host in ("", "localhost") or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    address = getattr(address, "ipv4_mapped", None) or address
    return address.is_loopback or address.is_unspecified


def _refuse(what: str) -> OSError:
    BEYOND_LOOPBACK.append(what)
    return OSError(f"tests reach loopback only, not {what}")


_getaddrinfo, _connect, _connect_ex = socket.getaddrinfo, socket.socket.connect, socket.socket.connect_ex


def _guarded_getaddrinfo(host, *args, **kwargs):
    if not is_local(host):
        raise _refuse(f"a lookup of {host!r}")
    return _getaddrinfo(host, *args, **kwargs)


def _destination(sock: socket.socket, address: object) -> str | None:
    if sock.family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple) and not is_local(address[0]):
        return f"a connection to {address[0]}:{address[1]}"
    return None


def _guarded_connect(self, address):
    where = _destination(self, address)
    if where:
        raise _refuse(where)
    return _connect(self, address)


def _guarded_connect_ex(self, address):
    where = _destination(self, address)
    if where:
        raise _refuse(where)
    return _connect_ex(self, address)


socket.getaddrinfo = _guarded_getaddrinfo
socket.socket.connect, socket.socket.connect_ex = _guarded_connect, _guarded_connect_ex
