"""The policy registry: policies by name, their settings validated, and built from both."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import ValidationError

from routing.policies.base import Policy, PolicySettings

_POLICIES: dict[str, type[Policy]] = {}

P = TypeVar("P", bound=type[Policy])


class PolicySettingsError(ValueError):
    """Settings a policy does not take or cannot use; `problems` holds (setting, why) pairs."""

    def __init__(self, policy: str, problems: list[tuple[str, str]]) -> None:
        self.policy = policy
        self.problems = problems
        super().__init__("; ".join(f"{key}: {why}" for key, why in problems))


def register(cls: P) -> P:
    """Class decorator: make the policy buildable by its `name` (and configurable by it)."""
    name = cls.name
    if name in _POLICIES and _POLICIES[name] is not cls:
        raise ValueError(f"two policies named {name!r}: {_POLICIES[name].__qualname__} and "
                         f"{cls.__qualname__}")
    _POLICIES[name] = cls
    return cls


def policy_names() -> list[str]:
    """The registered policies, sorted."""
    return sorted(_POLICIES)


def policy_class(name: str) -> type[Policy]:
    try:
        return _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of "
                         f"{', '.join(policy_names())}") from None


def settings_names(name: str) -> list[str]:
    """The settings policy `name` takes."""
    return sorted(policy_class(name).Settings.model_fields)


def describe_settings(name: str) -> str:
    taken = settings_names(name)
    return f"its settings: {', '.join(taken)}" if taken else "it takes no settings"


def validate_settings(name: str, settings: Mapping[str, Any]) -> PolicySettings:
    """Policy `name`'s settings model from `settings`, defaults filled in.

    Raises PolicySettingsError naming every setting the policy does not take or rejects."""
    model = policy_class(name).Settings
    try:
        return model.model_validate(dict(settings))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(settings)"
            if err["type"] == "extra_forbidden":
                why = f"not a setting of policy {name} ({describe_settings(name)})"
            else:
                why = f"invalid for policy {name}: {err['msg']}"
            problems.append((key, why))
        raise PolicySettingsError(name, problems) from None


def build_policy(name: str, settings: Mapping[str, Any] | None = None) -> Policy:
    """The policy `name` with `settings` (its defaults for what is left out).

    Raises ValueError on an unknown policy and on a setting the policy does not take or rejects.
    """
    cls = policy_class(name)
    return cls(validate_settings(name, settings or {}))
