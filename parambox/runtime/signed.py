"""Values in a run's store that only the run can write: each is signed with the run's secret.

torch's ``TCPStore`` has no authentication: any local process that reaches its port can list every
key (``list_keys``), read, overwrite and delete them and add to its counters, so a secret key prefix
would be no secret. What the run can refuse is a value it did not write: the launcher that hosts a
store draws a secret (:func:`host_secret`) and hands it to its workers in ``PARAMBOX_STORE_SECRET``
(the environment of a process is readable by its owner alone); a value goes in as an HMAC-SHA256 of
its key and itself, then the value (:func:`put`), and :func:`read` returns only what carries a valid
signature. A forged value (the audit's ``fenced=[1]``, which got rank 1 killed) is ignored, not obeyed.
Where no secret exists (a store under ``mpiexec``, which has no launcher of parambox to draw one),
values go in and out plain.

>>> import torch.distributed as dist
>>> store = dist.HashStore(); key = host_secret(store)
>>> put(store, "fenced", "[1]", key); read(store, "fenced", key)
'[1]'
>>> store.set("fenced", "[2]"); read(store, "fenced", key) is None
True
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import Any

SECRET_ENV = "PARAMBOX_STORE_SECRET"
_HOSTED: dict[int, str] = {}  # the secrets of the stores this process hosts, by port (or object id)


def host_secret(store: Any) -> str:
    """A new secret for ``store``, which this process hosts (hand it to the workers in ``SECRET_ENV``)."""
    secret = secrets.token_hex(16)
    _HOSTED[_port(store)] = secret
    return secret


def secret_of(store: Any) -> str | None:
    """The run's secret for ``store`` (or a ``PrefixStore`` over it): the one drawn where this process
    hosts it, else the one its launcher handed this worker; None where there is none."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return _HOSTED.get(_port(store)) or os.environ.get(SECRET_ENV) or None


def put(store: Any, key: str, value: str, secret: str | None = None) -> None:
    """``store[key] = value``, signed with ``secret`` (default: :func:`secret_of`)."""
    secret = secret_of(store) if secret is None else secret
    store.set(key, value if not secret else f"{_mac(secret, key, value)}:{value}")


def read(store: Any, key: str, secret: str | None = None) -> str | None:
    """``store[key]`` where the run wrote it: None where its signature is missing or wrong."""
    raw = store.get(key).decode()
    secret = secret_of(store) if secret is None else secret
    if not secret:
        return raw
    mac, sep, value = raw.partition(":")
    return value if sep and hmac.compare_digest(mac, _mac(secret, key, value)) else None


def _mac(secret: str, key: str, value: str) -> str:
    return hmac.new(secret.encode(), f"{key}\0{value}".encode(), hashlib.sha256).hexdigest()


def _port(store: Any) -> int:
    port = getattr(store, "port", None)
    return port if isinstance(port, int) else id(store)
