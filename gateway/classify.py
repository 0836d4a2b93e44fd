"""Traffic classes: which class (and so which engine pool) a request belongs to, and its
priority within the class."""

from __future__ import annotations

import re

from gateway.auth import ClientKey, class_not_allowed
from gateway.config import ClassificationConfig
from gateway.errors import bad_request

# An integer as a person writes it; int() alone would also take "1_000" and thousands of digits.
_INTEGER = re.compile(rb"\s*[+-]?[0-9]{1,18}\s*")
_UNSPECIFIC_TIERS = frozenset(("auto", "default"))


class Classifier:
    """Classifies by, in order: the class header, the API key, `service_tier`, the default.

    An explicit header naming an unknown class is an error rather than a silent fallback: a
    batch job that misspells its class must not land on the realtime pool.

    With an authenticated client key, the header and `service_tier` only choose among the
    key's classes (another one is a 403), and the key's own default replaces the rest.
    """

    def __init__(self, config: ClassificationConfig, classes: set[str]) -> None:
        self.header = config.header.encode() if config.header else None
        self.api_keys = {k.encode(): v for k, v in config.api_keys.items()}
        self.service_tier = dict(config.service_tier)
        self.default = config.default_class
        self.classes = classes
        self.priority_header = (config.priority_header.encode() if config.priority_header
                                else None)
        self.priority_keys = {k.encode(): v for k, v in config.priority_api_keys.items()}
        self.priority_min = config.priority_min
        self.priority_max = config.priority_max
        self.sets_priority = self.priority_header is not None or bool(self.priority_keys)
        """False: every request has priority 0 (nothing to read)."""

    def classify(self, headers: dict[bytes, bytes], service_tier: object,
                 client: ClientKey | None = None) -> str:
        if self.header is not None:
            value = headers.get(self.header)
            if value:
                name = value.decode("latin-1").strip()
                if name not in self.classes:
                    raise bad_request(
                        f"Unknown traffic class {name!r} in header "
                        f"{self.header.decode()}; known classes: {sorted(self.classes)}.",
                        code="unknown_traffic_class")
                if client is not None and name not in client.classes:
                    raise class_not_allowed(name, client.classes,
                                            f"header {self.header.decode()}")
                return name
        if client is not None:
            if isinstance(service_tier, str) and service_tier in self.service_tier:
                name = self.service_tier[service_tier]
                if name in client.classes:
                    return name
                # "auto" and "default" ask for nothing in particular (SDKs send them unasked):
                # the key's own default serves them. A named tier is a request: refused.
                if service_tier not in _UNSPECIFIC_TIERS:
                    raise class_not_allowed(name, client.classes,
                                            f"service_tier {service_tier!r}")
            return client.default_class
        if self.api_keys:
            auth = headers.get(b"authorization", b"")
            if auth[:7].lower() == b"bearer ":
                cls = self.api_keys.get(auth[7:].strip())
                if cls:
                    return cls
        if isinstance(service_tier, str) and service_tier in self.service_tier:
            return self.service_tier[service_tier]
        return self.default

    def priority(self, headers: dict[bytes, bytes], client: ClientKey | None = None) -> int:
        """The request's priority within its class: its priority header (clamped to the
        configured range) if it sends one, else its API key's, else 0."""
        priority = 0
        if client is not None and client.priority is not None:
            priority = min(max(client.priority, self.priority_min), self.priority_max)
        elif self.priority_keys:
            auth = headers.get(b"authorization", b"")
            if auth[:7].lower() == b"bearer ":
                priority = self.priority_keys.get(auth[7:].strip(), 0)
        if self.priority_header is not None:
            value = headers.get(self.priority_header)
            if value is not None:
                if not _INTEGER.fullmatch(value):
                    name = self.priority_header.decode()
                    raise bad_request(
                        f"Header {name} must be an integer (from {self.priority_min} to "
                        f"{self.priority_max}); got {value.decode('latin-1')[:40]!r}.",
                        code="invalid_priority")
                priority = min(max(int(value), self.priority_min), self.priority_max)
        return priority
