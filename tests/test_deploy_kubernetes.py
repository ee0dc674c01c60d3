"""deploy/kubernetes/ checked offline, nothing started:

- every manifest a kustomization lists exists, and every manifest is listed by one;
- built-in kinds validate against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: an unknown
  field fails) of the oldest and newest versions we support; kinds from CRDs (PodMonitor, InferencePool,
  Gateway, HTTPRoute), for which it has no schema, are checked structurally: required fields, their types,
  no field outside the ones the CRD defines at the levels we write;
- the container's `kvserve serve` arguments and KVSERVE_* variables parse with kvserve's own parser and
  validate as settings; the probes' paths are routes of kvserve's app, their port is the one --port binds;
  the grace period covers preStop + --shutdown-timeout + the abort flush and the core's exit;
- the references between objects hold: selectors match the pod's labels, named ports exist, the HPA's metric
  is the one the Prometheus adapter rule serves from a series kvserve exposes, the pool's ports and EPP exist.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
NOT_MANIFESTS = {"kustomization.yaml", "prometheus-adapter-values.yaml"}
ABORT_FLUSH_S, CORE_EXIT_S = 10, 5  # frontend.py waits 10 s for aborted requests; the core exits in ~1-2 s

# Kinds from CRDs: the fields each must have (dotted path -> type), and the keys allowed at given levels (the
# CRDs' own fields there: a misspelt key fails).
CRD_SHAPES = {
    ("monitoring.coreos.com/v1", "PodMonitor"): {
        "required": {"spec.selector.matchLabels": dict, "spec.podMetricsEndpoints": list},
        "allowed": {"spec": {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels",
                             "sampleLimit", "targetLimit", "attachMetadata", "scrapeProtocols"},
                    "spec.podMetricsEndpoints[]": {"port", "portNumber", "path", "interval", "scrapeTimeout",
                                                   "scheme", "params", "relabelings", "metricRelabelings",
                                                   "honorLabels", "honorTimestamps", "enableHttp2"}}},
    ("inference.networking.k8s.io/v1", "InferencePool"): {
        "required": {"spec.selector.matchLabels": dict, "spec.targetPorts": list, "spec.endpointPickerRef.name": str,
                     "spec.endpointPickerRef.port.number": int},
        "allowed": {"spec": {"selector", "targetPorts", "appProtocol", "endpointPickerRef"},
                    "spec.endpointPickerRef": {"group", "kind", "name", "port", "failureMode"},
                    "spec.targetPorts[]": {"number"}}},
    ("gateway.networking.k8s.io/v1", "Gateway"): {
        "required": {"spec.gatewayClassName": str, "spec.listeners": list},
        "allowed": {"spec": {"gatewayClassName", "listeners", "addresses", "infrastructure", "tls",
                             "allowedListeners", "backendTLS"},
                    "spec.listeners[]": {"name", "hostname", "port", "protocol", "tls", "allowedRoutes"}}},
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): {
        "required": {"spec.parentRefs": list, "spec.rules": list},
        "allowed": {"spec": {"parentRefs", "hostnames", "rules"},
                    "spec.rules[]": {"name", "matches", "filters", "backendRefs", "timeouts", "retry",
                                     "sessionPersistence"},
                    "spec.rules[].backendRefs[]": {"group", "kind", "name", "namespace", "port", "weight",
                                                   "filters"}}},
}


# ---- reading the tree -----------------------------------------------------------------------------------
def kustomizations() -> list[Path]:
    return sorted(ROOT.rglob("kustomization.yaml"))


def listed_resources(kustomization: Path) -> list[Path]:
    data = yaml.safe_load(kustomization.read_text())
    return [(kustomization.parent / r).resolve() for r in data.get("resources", [])]


def manifest_files() -> list[Path]:
    return sorted(p.resolve() for p in ROOT.rglob("*.yaml") if p.name not in NOT_MANIFESTS)


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def all_documents() -> list[dict]:
    return [d for p in manifest_files() for d in documents(p)]


def one(kind: str, name: str) -> dict:
    found = [d for d in all_documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def kvserve_container() -> dict:
    return one("Deployment", "kvserve")["spec"]["template"]["spec"]["containers"][0]


def pod_labels() -> dict:
    return one("Deployment", "kvserve")["spec"]["template"]["metadata"]["labels"]


# ---- kustomize wiring ------------------------------------------------------------------------------------
def test_kustomizations_list_every_manifest_and_only_existing_ones():
    listed = set()
    for k in kustomizations():
        for resource in listed_resources(k):
            assert resource.exists(), f"{k} lists {resource}, which does not exist"
            listed.add(resource)
    orphans = [p for p in manifest_files() if p not in listed]
    assert not orphans, f"manifests no kustomization applies: {orphans}"
    assert {p.parent.name for p in kustomizations()} >= {"base", "production", "inference-gateway"}


# ---- schemas -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_manifests_validate(path):
    for doc in documents(path):
        assert doc.get("apiVersion") and doc.get("kind") and doc.get("metadata", {}).get("name"), doc
        shape = CRD_SHAPES.get((doc["apiVersion"], doc["kind"]))
        if shape is not None:
            check_shape(doc, shape)
            continue
        for version in K8S_VERSIONS:  # raises ValidationError with the offending field
            kubernetes_validate.validate(doc, version, strict=True)


def values_at(doc, path: str) -> list:
    """Every value at a dotted path; a `[]` suffix on a part walks into each item of that list."""
    values = [doc]
    for part in path.split("."):
        key, each = part.removesuffix("[]"), part.endswith("[]")
        values = [v[key] for v in values if isinstance(v, dict) and key in v]
        if each:
            values = [item for v in values for item in v]
    return values


def check_shape(doc: dict, shape: dict) -> None:
    for path, kind in shape["required"].items():
        values = values_at(doc, path)
        assert values and all(isinstance(v, kind) for v in values), f"{doc['kind']}: {path} must be a {kind}"
    for path, allowed in shape["allowed"].items():
        for value in values_at(doc, path):
            assert set(value) <= allowed, f"{doc['kind']}: unknown fields at {path}: {set(value) - allowed}"


def test_shape_check_catches_a_misspelt_field():
    pool = one("InferencePool", "kvserve")
    bad = {**pool, "spec": {**pool["spec"], "endpointPickerRef": {**pool["spec"]["endpointPickerRef"], "prot": 1}}}
    with pytest.raises(AssertionError, match="prot"):
        check_shape(bad, CRD_SHAPES[("inference.networking.k8s.io/v1", "InferencePool")])
    deployment = one("Deployment", "kvserve")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


# ---- the container against kvserve itself -----------------------------------------------------------------
def serve_settings():
    """The container's args and KVSERVE_* env through kvserve's own parser and settings (nothing started)."""
    from server.cli import build_parser
    from server.settings import NOT_OPTIONS, all_options, resolve

    container = kvserve_container()
    args = container["args"]
    assert args[0] == "serve"
    parsed = vars(build_parser(args).parse_args(args))  # an unknown flag or a bad value exits (SystemExit)
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    options = {"KVSERVE_" + o.name.upper() for o in all_options()} | set(NOT_OPTIONS)
    assert set(env) <= options, f"unknown KVSERVE_* variables: {set(env) - options}"
    return resolve({k: v for k, v in parsed.items() if k != "command"}, env=env)


def app_routes() -> set[str]:
    """The paths kvserve's app serves (an app over an engine core that never answers: nothing starts)."""
    from test_server_http import loading_app

    app, release = loading_app()
    try:
        return {route.path for route in app.routes}
    finally:
        release()


def test_serve_flags_and_env_are_kvserves():
    engine, settings = serve_settings()
    assert settings.host == "0.0.0.0"  # reachable from the kubelet and the Service, not loopback only
    assert engine.device == "cuda"


def test_probes_hit_kvserve_routes_on_the_port_it_binds():
    _, settings = serve_settings()
    container = kvserve_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == settings.port
    probes = {name: container[name]["httpGet"] for name in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["startupProbe"]["path"] == probes["livenessProbe"]["path"] == "/health"
    assert probes["readinessProbe"]["path"] == "/ready"
    routes = app_routes()
    for probe in probes.values():
        assert probe["path"] in routes
        assert ports.get(probe["port"], probe["port"]) == settings.port


def test_grace_period_covers_prestop_and_the_drain():
    _, settings = serve_settings()
    container = kvserve_container()
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    needed = int(command[1]) + settings.shutdown_timeout + ABORT_FLUSH_S + CORE_EXIT_S
    grace = one("Deployment", "kvserve")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= needed, f"terminationGracePeriodSeconds {grace} < preStop + drain + abort + exit = {needed}"


def test_gpu_requested_and_resources_limited():
    resources = kvserve_container()["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == "1"
    assert {"cpu", "memory"} <= set(resources["limits"]) and {"cpu", "memory"} <= set(resources["requests"])


# ---- references between objects -------------------------------------------------------------------------
def test_selectors_and_ports_reach_the_kvserve_pods():
    labels, ports = pod_labels(), {p["name"] for p in kvserve_container()["ports"]}
    service = one("Service", "kvserve")
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    for kind in ("PodDisruptionBudget", "PodMonitor", "InferencePool"):
        assert one(kind, "kvserve")["spec"]["selector"]["matchLabels"].items() <= labels.items(), kind
    assert {e["port"] for e in one("PodMonitor", "kvserve")["spec"]["podMetricsEndpoints"]} <= ports
    assert one("PodMonitor", "kvserve")["spec"]["podMetricsEndpoints"][0]["path"] in app_routes()


def test_hpa_scales_the_deployment_on_a_metric_kvserve_exposes():
    from engine.core.messages import CoreStats
    from server.metrics import ServerMetrics

    hpa = one("HorizontalPodAutoscaler", "kvserve")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "kvserve"}
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    adapter = yaml.safe_load((ROOT / "prometheus-adapter-values.yaml").read_text())
    rule = next(r for r in adapter["rules"]["custom"] if r["name"]["as"] == metric)
    series = rule["seriesQuery"].split("{")[0]
    assert series == "vllm:num_requests_waiting"
    exposed = ServerMetrics(lambda: CoreStats()).render().decode()
    assert f"# TYPE {series} gauge" in exposed


def test_inference_pool_points_at_kvserve_and_its_endpoint_picker():
    pool = one("InferencePool", "kvserve")["spec"]
    assert [p["number"] for p in pool["targetPorts"]] == [kvserve_container()["ports"][0]["containerPort"]]
    epp_service = one("Service", pool["endpointPickerRef"]["name"])
    assert pool["endpointPickerRef"]["port"]["number"] in [p["port"] for p in epp_service["spec"]["ports"]]
    epp = one("Deployment", "kvserve-epp")["spec"]["template"]
    assert epp_service["spec"]["selector"].items() <= epp["metadata"]["labels"].items()
    args = epp["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == "kvserve"
    route = one("HTTPRoute", "kvserve")["spec"]
    backend = route["rules"][0]["backendRefs"][0]
    assert (backend["group"], backend["kind"], backend["name"]) == ("inference.networking.k8s.io", "InferencePool",
                                                                    "kvserve")
    assert route["parentRefs"][0]["name"] == one("Gateway", "kvserve-gateway")["metadata"]["name"]
    prefix = route["rules"][0]["matches"][0]["path"]["value"]
    assert prefix == "/v1" and {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= app_routes()
