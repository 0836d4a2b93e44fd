"""Who is calling: client, admin and metrics keys checked by their SHA-256 digests (pure)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.config import AuthConfig, GatewayConfig, RateLimitConfig
from gateway.errors import GatewayError


@dataclass(frozen=True, slots=True)
class ClientKey:
    """An authenticated client: its name (never the key) and what it may do."""

    name: str
    classes: frozenset[str]
    default_class: str
    priority: int | None
    limits: RateLimitConfig | None


def bearer(headers: Mapping[bytes, bytes]) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` header, or None."""
    auth = headers.get(b"authorization")
    if not auth or auth[:7].lower() != b"bearer ":
        return None
    token = auth[7:].strip()
    return token or None


def digest(token: bytes) -> str:
    # Keys are compared by digest in a dict: what a lookup's timing could reveal is about the
    # digest, which says nothing usable about any key.
    return "sha256:" + hashlib.sha256(token).hexdigest()


def unauthenticated(missing: bool) -> GatewayError:
    """401, worded like OpenAI's; the key itself is never echoed."""
    message = ("You didn't provide an API key. You need to provide your API key in an "
               "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
               if missing else "Incorrect API key provided.")
    return GatewayError(401, message, type="invalid_request_error", code="invalid_api_key")


def class_not_allowed(cls: str, allowed: frozenset[str], source: str) -> GatewayError:
    return GatewayError(
        403, f"Your API key may not use traffic class {cls!r} (asked for by {source}); it may "
        f"use {sorted(allowed)}.", type="permission_error", code="traffic_class_not_allowed")


def admin_disabled() -> GatewayError:
    return GatewayError(
        403, "The admin API is disabled: this gateway has client keys but no admin key "
        "(auth.admin_keys, or prefix-gateway up --admin-key).", type="permission_error",
        code="admin_disabled")


CLIENT_SCOPE = "prefix_gateway.client"
"""The ASGI scope key under which the HTTP edge leaves the authenticated ClientKey."""

UNAUTHENTICATED_HEADERS = [(b"www-authenticate", b'Bearer realm="prefix-gateway"')]


class Authenticator:
    """The configured keys, by digest; every check is a hash and a dict lookup."""

    def __init__(self, config: GatewayConfig) -> None:
        auth: AuthConfig = config.auth
        classes = [c.name for c in config.traffic_classes]
        default = config.classification.default_class
        self.clients: dict[str, ClientKey] = {}
        for k in auth.api_keys:
            allowed = list(k.classes or classes)
            self.clients[k.digest] = ClientKey(
                k.name, frozenset(allowed),
                k.default_class or (default if default in allowed else allowed[0]),
                k.priority, k.limits)
        self.admins = {k.digest: k.name for k in auth.admin_keys}
        self.metrics = {k.digest: k.name for k in auth.metrics_keys} if auth.metrics_keys \
            else {}
        if self.metrics:
            self.metrics.update(self.admins)  # an admin may read the metrics too
        self.client_required = bool(self.clients)
        self.admin_required = bool(self.admins) or self.client_required
        """An open admin API only on an open gateway (loopback, or allowed explicitly)."""
        self.metrics_required = bool(self.metrics)

    def client(self, headers: Mapping[bytes, bytes]) -> ClientKey | None:
        """The calling client; None when no client keys are configured; 401 otherwise."""
        if not self.client_required:
            return None
        token = bearer(headers)
        if token is None:
            raise unauthenticated(missing=True)
        found = self.clients.get(digest(token))
        if found is None:
            raise unauthenticated(missing=False)
        return found

    def admin(self, headers: Mapping[bytes, bytes]) -> str | None:
        """The admin's key name (None: the admin API is open); 401 or 403 otherwise."""
        if not self.admin_required:
            return None
        if not self.admins:
            raise admin_disabled()
        return self._named(self.admins, headers)

    def metrics_reader(self, headers: Mapping[bytes, bytes]) -> str | None:
        if not self.metrics_required:
            return None
        return self._named(self.metrics, headers)

    @staticmethod
    def _named(keys: dict[str, str], headers: Mapping[bytes, bytes]) -> str:
        token = bearer(headers)
        if token is None:
            raise unauthenticated(missing=True)
        name = keys.get(digest(token))
        if name is None:
            raise unauthenticated(missing=False)
        return name
