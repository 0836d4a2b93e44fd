"""The docs keep up with the code: every configuration key and policy setting is documented
with its default, every metric with its type and labels, and every relative link in README.md
and docs/ leads to a file (and section) that exists."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from gateway.config import GatewayConfig
from routing.policies import policy_class, policy_names
from tests.conftest import ROOT

CONFIG_DOC = ROOT / "docs" / "configuration.md"
LINKED_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# Configuration reference --------------------------------------------------------------------


def tables(text: str) -> list[dict[str, str]]:
    """Every Markdown table of `text` whose first column holds `key`s: key -> its whole row."""
    out: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            m = re.match(r"\|\s*`([A-Za-z_][A-Za-z0-9_]*)`\s*\|", line)
            if m:
                current[m.group(1)] = line
        elif current:
            out.append(current)
            current = {}
    return out


def nested_models(annotation: object) -> list[type[BaseModel]]:
    """The pydantic models inside a field's annotation (`X`, `list[X]`, `X | None`, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        for arg in typing.get_args(annotation):
            found += nested_models(arg)
    return found


def config_models(root: type[BaseModel] = GatewayConfig) -> list[type[BaseModel]]:
    """`root` and every model reachable through its fields, each once."""
    seen: list[type[BaseModel]] = []
    todo = [root]
    while todo:
        model = todo.pop(0)
        if model in seen:
            continue
        seen.append(model)
        for field in model.model_fields.values():
            todo += nested_models(field.annotation)
    return seen


def shown_default(model: type[BaseModel], key: str) -> str | None:
    """The default as the doc writes it (`true`, `4`, `0.25`, `chars`), or None when the field
    is required, has no scalar default, or defaults to None (which the doc may describe)."""
    default = model.model_fields[key].default
    if default is PydanticUndefined or default is None:
        return None
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    if isinstance(default, int | float | str):
        return str(default)
    return None


def documented(model: type[BaseModel], doc: str) -> tuple[list[str], list[str]]:
    """(keys the doc's best table for `model` lacks, keys whose row does not show the default)."""
    keys = list(model.model_fields)
    best = max(tables(doc), key=lambda t: len(set(keys) & set(t)), default={})
    missing = [k for k in keys if k not in best]
    wrong = [k for k in keys if k in best and (d := shown_default(model, k)) is not None
             and f"`{d}`" not in best[k].split("|")[2]]
    return missing, wrong


@pytest.fixture(scope="module")
def config_doc() -> str:
    return CONFIG_DOC.read_text()


def test_the_walk_finds_every_config_model() -> None:
    names = {m.__name__ for m in config_models()}
    assert {"ServerConfig", "RoutingSettings", "PoolConfig", "ReplicaConfig", "HealthSettings",
            "TrafficClassConfig", "ClassificationConfig"} <= names


@pytest.mark.parametrize("model", [m for m in config_models() if m is not GatewayConfig],
                         ids=lambda m: m.__name__)
def test_every_config_key_is_in_the_reference_with_its_default(model, config_doc) -> None:
    missing, wrong = documented(model, config_doc)
    assert missing == [], f"docs/configuration.md has no row for {model.__name__}: {missing}"
    assert wrong == [], f"docs/configuration.md shows another default for {wrong}"


def test_every_top_level_section_has_its_heading(config_doc) -> None:
    headings = set(re.findall(r"^## (\S+)$", config_doc, flags=re.M))
    assert set(GatewayConfig.model_fields) - headings == set()


# The project's own policies: a test may register one of its own, and whether this module
# is collected after it depends on which files pytest was given.
@pytest.mark.parametrize("policy", [n for n in policy_names()
                                    if policy_class(n).__module__.startswith("routing.")])
def test_every_policy_setting_is_in_the_reference_with_its_default(policy, config_doc) -> None:
    settings = policy_class(policy).Settings
    section = re.search(rf"^#### [^\n]*\b{policy}\b[^\n]*$(.*?)(?=^#{{1,4}} )", config_doc,
                        flags=re.M | re.S)
    assert section, f"docs/configuration.md has no #### heading for policy {policy}"
    if not settings.model_fields:
        assert "no settings" in section.group(1)
        return
    missing, wrong = documented(settings, section.group(1))
    assert missing == [], f"settings of {policy} missing from docs/configuration.md: {missing}"
    assert wrong == [], f"docs/configuration.md shows another default for {wrong}"


def test_a_missing_key_or_a_wrong_default_is_caught() -> None:
    from gateway.config import HealthSettings

    lines = [f"| `{k}` | `{shown_default(HealthSettings, k)}` | x |"
             for k in HealthSettings.model_fields]
    rows = "\n".join(lines)
    assert documented(HealthSettings, rows) == ([], [])
    assert documented(HealthSettings, "\n".join(x for x in lines if "timeout_s" not in x)) \
        == (["timeout_s"], [])
    assert documented(HealthSettings, rows.replace("`60`", "`30`")) \
        == ([], ["hit_ratio_window_s"])


# Links ------------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # not inside code blocks
    return [t for t in LINK.findall(text)
            if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_that_exist(doc: Path) -> None:
    broken = [t for t in relative_links(doc) if not (doc.parent / t.split("#")[0]).exists()]
    assert broken == []


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_to_a_section_name_one_that_exists(doc: Path) -> None:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        path, _, anchor = target.partition("#")
        if not anchor or re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue
        linked = doc.parent / path if path else doc
        if linked.suffix == ".md" and linked.exists() and anchor not in anchors(linked):
            broken.append(target)
    assert broken == []


def test_the_link_check_sees_links(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("[a](other.md#x) [b](https://example.com) [c](#here)\n```\n[d](no.md)\n```")
    assert relative_links(page) == ["other.md#x"]
    assert relative_links(ROOT / "README.md"), "README.md links to docs/"
    assert {"the-gateways-own-cost-overhead", "failover-retries-and-resends"} <= \
        anchors(ROOT / "docs" / "benchmarks.md") | anchors(ROOT / "docs" / "operating.md")


# Metrics reference ------------------------------------------------------------------------------


def test_every_metric_is_in_the_operating_reference_as_exported_with_its_labels() -> None:
    from gateway.metrics import GatewayMetrics

    rows = {row.split("|")[1].strip(" `"): row for row in
            re.findall(r"^\| `gateway_\w+` \|.*$", (ROOT / "docs" / "operating.md").read_text(),
                       flags=re.M)}
    exported = {}
    for family in GatewayMetrics().families():
        name = family.name + ("_total" if family.kind == "counter" else "")
        exported[name] = (family.kind, set(family.labels))
    assert set(rows) == set(exported)
    for name, (kind, labels) in exported.items():
        cells = [c.strip() for c in rows[name].split("|")]
        assert cells[2] == kind, name
        assert {x.strip() for x in cells[3].split(",")} - {"(none)"} == labels, name
