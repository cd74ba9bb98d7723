"""tools/charts.py: the checks of the trainer's worker group (ranks in its Pod, worker Pods of a
StatefulSet, or a RayCluster), the shared artifact store and the env service's node access catch
what they promise to. Each test renders a chart with Helm (as `make charts` does) and breaks one
thing in the rendering."""

from __future__ import annotations

import copy
import importlib.util
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _load_charts() -> Any:
    spec = importlib.util.spec_from_file_location("orchard_charts", ROOT / "tools" / "charts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


charts = _load_charts()
Docs = list[dict[str, Any]]


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="orchard-charts-test-") as tmp:
        yield Path(tmp)


def render(workdir: Path, chart: str, files: tuple[str, ...], **values: Any) -> Docs:
    import helm_python as helm

    merged = charts.deep_merge(charts.load_values(charts.CHARTS / chart, files), values)
    loaded = helm.Chart.load(charts.staged_chart(chart, workdir))
    try:
        rendered = loaded.render(merged, name="orchard", namespace="orchard", is_install=True)
    finally:
        loaded.close()
    return [doc for _, doc in charts.documents(rendered)]


def failures(check: Any, docs: Docs) -> list[str]:
    report = charts.Report()
    check(docs, report, "case")
    return list(report.failures)


def one(docs: Docs, kind: str, name_part: str = "") -> dict[str, Any]:
    found: Docs = charts.find(docs, kind, name_part)
    assert len(found) == 1, [charts.kind_name(d) for d in found]
    return found[0]


@pytest.fixture(scope="module")
def ray(workdir: Path) -> Docs:
    return render(workdir, "trainer", ("ci/workers-ray-values.yaml",))


@pytest.fixture(scope="module")
def umbrella(workdir: Path) -> Docs:
    return render(workdir, charts.UMBRELLA, ("ci/all-services-values.yaml",))


def test_the_ray_worker_group_as_rendered_passes(ray: Docs) -> None:
    assert failures(charts.check_worker_group("ray", 2, gpus_per_rank=1), ray) == []
    assert failures(charts.check_artifacts, ray) == []
    assert failures(charts.check_workloads, ray) == []
    # Another rank count, no GPUs per rank, or no worker group is not what was rendered.
    assert failures(charts.check_worker_group("ray", 3, gpus_per_rank=1), ray)
    assert failures(charts.check_worker_group("ray", 2), ray)
    assert failures(charts.check_worker_group("subprocess", 1), ray)


def test_ranks_in_the_trainer_pod_render_no_worker_group(workdir: Path) -> None:
    docs = render(workdir, "trainer", ("ci/standalone-values.yaml",))
    assert failures(charts.check_worker_group("subprocess", 1), docs) == []
    assert not charts.find(docs, "RayCluster")
    assert not charts.find(docs, "StatefulSet")
    assert failures(charts.check_worker_group("ray", 1), docs)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("service_selects_workers", "must not select the RayCluster's Pods"),
        ("address", "workers.ray.address must be"),
        ("worker_gpus", "must ask for 1 GPUs"),
        ("config_gpus", "must ask for 1 GPUs"),
        ("ranks", "one worker group of 2 Pods"),
        ("config_kind", "must say kind ray, 2 ranks"),
    ],
)
def test_a_broken_worker_group_is_caught(ray: Docs, change: str, expected: str) -> None:
    docs = copy.deepcopy(ray)
    cluster = one(docs, "RayCluster")
    [group] = cluster["spec"]["workerGroupSpecs"]
    config_map = one(docs, "ConfigMap")
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    if change == "service_selects_workers":
        trainer_service = next(
            d for d in charts.find(docs, "Service") if d["metadata"]["name"] == "orchard-trainer"
        )
        trainer_service["spec"]["selector"] = {"app.kubernetes.io/instance": "orchard"}
    elif change == "address":
        config["workers"]["ray"]["address"] = "ray://orchard-trainer-ray-head-svc:10001"
    elif change == "worker_gpus":
        group["template"]["spec"]["containers"][0]["resources"]["limits"].pop("nvidia.com/gpu")
    elif change == "config_gpus":
        config["workers"]["ray"]["gpus_per_rank"] = 0
    elif change == "ranks":
        group["replicas"] = 1
    elif change == "config_kind":
        config["workers"]["kind"] = "pods"
    config_map["data"]["config.yaml"] = yaml.safe_dump(config)
    found = failures(charts.check_worker_group("ray", 2, gpus_per_rank=1), docs)
    assert any(expected in f for f in found), found


def test_the_raycluster_shape_and_templates_are_checked(ray: Docs) -> None:
    report = charts.Report()
    charts.validate_schemas(ray, report, "case")
    assert report.failures == []
    cluster = one(ray, "RayCluster")
    broken = copy.deepcopy(cluster)
    broken["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["bogus"] = 1
    broken["spec"]["workerGroupSpecs"][0]["rayStartParams"] = {"num-cpus": 2}
    broken["spec"]["workerGroupSpecs"][0]["minReplicas"] = 5
    broken["spec"]["autoscaling"] = True
    report = charts.Report()
    charts.check_ray_cluster(broken, report, "case")
    text = "\n".join(report.failures)
    assert "unknown fields ['autoscaling']" in text
    assert "headGroupSpec.template: spec/containers/0" in text
    assert "rayStartParams must map to strings" in text
    assert "minReplicas <= replicas <= maxReplicas" in text


def test_an_artifact_store_split_between_pods_is_caught(umbrella: Docs) -> None:
    docs = copy.deepcopy(umbrella)
    [group] = one(docs, "RayCluster")["spec"]["workerGroupSpecs"]
    [store] = [v for v in group["template"]["spec"]["volumes"] if v["name"] == "artifacts"]
    store["persistentVolumeClaim"]["claimName"] = "another"
    assert any("one shared claim" in f for f in failures(charts.check_artifacts, docs))


def test_ray_ranks_scratch_on_the_shared_claim(ray: Docs) -> None:
    assert failures(charts.check_worker_group("ray", 2, gpus_per_rank=1), ray) == []
    docs = copy.deepcopy(ray)
    [group] = one(docs, "RayCluster")["spec"]["workerGroupSpecs"]
    group["template"]["spec"]["containers"][0]["volumeMounts"] = [
        m
        for m in group["template"]["spec"]["containers"][0]["volumeMounts"]
        if m["name"] != "artifacts"
    ]
    found = failures(charts.check_worker_group("ray", 2, gpus_per_rank=1), docs)
    assert any("scratch_dir" in f for f in found), found


@pytest.fixture(scope="module")
def pods(workdir: Path) -> Docs:
    return render(workdir, "trainer", ("ci/workers-pods-values.yaml",))


def test_the_pod_worker_group_as_rendered_passes(pods: Docs) -> None:
    check = charts.check_pod_workers(2, gpus_per_rank=1)
    assert failures(check, pods) == []
    for general in (
        charts.check_artifacts,
        charts.check_workloads,
        charts.check_metrics,
        charts.check_service_configs,
    ):
        assert failures(general, pods) == [], general
    assert one(pods, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["command"][:2] == [
        "orchard-trainer",
        "worker",
    ]
    # Another rank count, no GPUs per rank, or no worker group is not what was rendered.
    assert failures(charts.check_pod_workers(3, gpus_per_rank=1), pods)
    assert failures(charts.check_pod_workers(2), pods)
    assert failures(charts.check_worker_group("subprocess", 1), pods)


def test_an_existing_key_secret_is_used_and_none_is_made(workdir: Path) -> None:
    docs = render(
        workdir,
        "trainer",
        ("ci/workers-pods-values.yaml",),
        workers={"pods": {"existingSecret": "trainer-key"}},
    )
    assert not charts.find(docs, "Secret")
    assert failures(charts.check_pod_workers(2, gpus_per_rank=1), docs) == []
    volumes = one(docs, "StatefulSet")["spec"]["template"]["spec"]["volumes"]
    assert {"secretName": "trainer-key", "defaultMode": 0o440} in [v.get("secret") for v in volumes]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("endpoints", "workers.pods.endpoints"),
        ("key_path", "must mount the worker key Secret where workers.pods.key_file"),
        ("other_key", "mount different keys"),
        ("open_policy", "must admit only the trainer (worker port) and the workers"),
        ("all_pods", "must admit only the trainer (worker port) and the workers"),
        ("other_namespaces", "must admit only the trainer (worker port) and the workers"),
        ("scratch", "must lie on a claim every worker Pod mounts"),
        ("service_selects_workers", "must not select the worker Pods"),
        ("replicas", "needs 2 Pods (one per rank)"),
        ("not_headless", "needs a headless Service"),
    ],
)
def test_a_broken_pod_worker_group_is_caught(pods: Docs, change: str, expected: str) -> None:
    docs = copy.deepcopy(pods)
    workers = one(docs, "StatefulSet")
    pod = workers["spec"]["template"]["spec"]
    config_map = one(docs, "ConfigMap")
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    if change == "endpoints":
        config["workers"]["pods"]["endpoints"][1] = "orchard-trainer-workers-1:7410"
    elif change == "key_path":
        config["workers"]["pods"]["key_file"] = "/etc/orchard/key"
    elif change == "other_key":
        [key] = [v for v in pod["volumes"] if v["name"] == "worker-key"]
        key["secret"]["secretName"] = "another-key"
    elif change == "open_policy":
        one(docs, "NetworkPolicy")["spec"]["ingress"].append({"from": [{"podSelector": {}}]})
    elif change == "all_pods":
        rules = one(docs, "NetworkPolicy")["spec"]["ingress"]
        rules.append({"from": [{"podSelector": {"matchLabels": {}}}]})
    elif change == "other_namespaces":
        [rule, _] = one(docs, "NetworkPolicy")["spec"]["ingress"]
        rule["from"][0]["namespaceSelector"] = {}
    elif change == "scratch":
        config["weights"]["scratch_dir"] = "/tmp/trainer-scratch"
    elif change == "service_selects_workers":
        trainer_service = next(
            d for d in charts.find(docs, "Service") if d["metadata"]["name"] == "orchard-trainer"
        )
        trainer_service["spec"]["selector"] = {"app.kubernetes.io/instance": "orchard"}
    elif change == "replicas":
        workers["spec"]["replicas"] = 1
    elif change == "not_headless":
        headless = next(
            d for d in charts.find(docs, "Service") if d["metadata"]["name"].endswith("-workers")
        )
        headless["spec"]["clusterIP"] = "10.0.0.7"
    config_map["data"]["config.yaml"] = yaml.safe_dump(config)
    found = failures(charts.check_pod_workers(2, gpus_per_rank=1), docs)
    assert any(expected in f for f in found), found


def test_a_pod_worker_config_the_trainer_refuses_is_caught(pods: Docs) -> None:
    docs = copy.deepcopy(pods)
    config_map = one(docs, "ConfigMap")
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    config["weights"]["scratch_dir"] = "trainer-scratch"
    config_map["data"]["config.yaml"] = yaml.safe_dump(config)
    found = failures(charts.check_service_configs, docs)
    assert any("must be an absolute path on a volume" in f for f in found), found


def test_the_umbrella_shares_one_claim(umbrella: Docs) -> None:
    assert failures(charts.check_artifacts, umbrella) == []
    assert failures(charts.check_worker_group("ray", 2), umbrella) == []
    claim = one(umbrella, "PersistentVolumeClaim", "artifacts")
    assert claim["metadata"]["name"] == "orchard-artifacts"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    mounted = [
        (kind, next(v for v in pod["volumes"] if v["name"] == "artifacts"))
        for kind, pod in charts._artifact_pods(umbrella)
    ]
    # The RayCluster's head and its worker group both mount the store.
    assert sorted(kind for kind, _ in mounted) == [
        "Deployment/orchard/orchard-rollout",
        "Deployment/orchard/orchard-trainer",
        "RayCluster/orchard/orchard-trainer-ray",
        "RayCluster/orchard/orchard-trainer-ray",
    ]
    assert {v["persistentVolumeClaim"]["claimName"] for _, v in mounted} == {"orchard-artifacts"}


def test_the_env_clusterrole_reads_nodes_only(workdir: Path) -> None:
    docs = render(workdir, "env", ("ci/standalone-values.yaml",))
    assert failures(charts.check_env, docs) == []
    role = one(docs, "ClusterRole")
    role["rules"][0]["verbs"].append("patch")
    assert any("want get, list, watch on nodes" in f for f in failures(charts.check_env, docs))
    off = render(
        workdir, "env", ("ci/standalone-values.yaml",), sandbox={"imageLocality": {"weight": 0}}
    )
    assert not charts.find(off, "ClusterRole")
    assert failures(charts.check_env, off) == []
    [config_map] = [d for d in charts.find(off, "ConfigMap") if "config.yaml" in d["data"]]
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert config["runtime"]["image_locality_weight"] == 0


def test_workers_keys_the_trainer_model_lacks_are_named_not_failed() -> None:
    from pydantic import Field

    from orchard.core.config import ConfigModel

    class Workers(ConfigModel):
        ranks: int = Field(default=1, description="ranks")

    class Trainer(ConfigModel):
        workers: Workers = Field(default_factory=Workers)

    charts.UNMODELLED_KEYS.clear()
    config = {"server": {}, "workers": {"kind": "ray", "ranks": 2}}
    kept = charts._without_unmodelled_workers("trainer", Trainer, config)
    assert kept == {"server": {}, "workers": {"ranks": 2}}
    assert sorted(charts.UNMODELLED_KEYS) == ["trainer: workers.kind"]
