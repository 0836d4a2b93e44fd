"""Traffic classes: which class (and so which engine pool) a request belongs to."""

from __future__ import annotations

from gateway.config import ClassificationConfig
from gateway.errors import bad_request


class Classifier:
    """Classifies by, in order: the class header, the API key, `service_tier`, the default.

    An explicit header naming an unknown class is an error rather than a silent fallback: a
    batch job that misspells its class must not land on the realtime pool.
    """

    def __init__(self, config: ClassificationConfig, classes: set[str]) -> None:
        self.header = config.header.encode() if config.header else None
        self.api_keys = {k.encode(): v for k, v in config.api_keys.items()}
        self.service_tier = dict(config.service_tier)
        self.default = config.default_class
        self.classes = classes

    def classify(self, headers: dict[bytes, bytes], service_tier: object) -> str:
        if self.header is not None:
            value = headers.get(self.header)
            if value:
                name = value.decode("latin-1").strip()
                if name not in self.classes:
                    raise bad_request(
                        f"Unknown traffic class {name!r} in header "
                        f"{self.header.decode()}; known classes: {sorted(self.classes)}.",
                        code="unknown_traffic_class")
                return name
        if self.api_keys:
            auth = headers.get(b"authorization", b"")
            if auth[:7].lower() == b"bearer ":
                cls = self.api_keys.get(auth[7:].strip())
                if cls:
                    return cls
        if isinstance(service_tier, str) and service_tier in self.service_tier:
            return self.service_tier[service_tier]
        return self.default
