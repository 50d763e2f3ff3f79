"""docker-compose.yml, the Dockerfile and deploy/kubernetes/ agree with the files, the launcher's
flags and Kubernetes' schemas (Docker and a cluster cannot run here, so they are checked
statically: the manifests against Kubernetes' OpenAPI schemas, offline, with kubernetes-validate)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from unittest import mock

import kubernetes_validate
import pytest
import yaml

from launcher.config import LauncherConfig, parse_args

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
# the oldest Kubernetes the manifests claim (LeaderWorkerSet's own floor is older), and the newest
# kubernetes-validate knows
KUBERNETES_VERSIONS = ("1.27", kubernetes_validate.latest_version())
# custom resources, whose schemas are not Kubernetes': checked by hand below
CRD_KINDS = {("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
             ("monitoring.coreos.com/v1", "ServiceMonitor")}
# what LeaderWorkerSet's controller sets in every container of a group (api/leaderworkerset/v1)
LWS_ENV = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}
LEADER_ADDRESS = "tgi-py-multinode-0.tgi-py-multinode.default"


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _host_paths(service: dict) -> list[Path]:
    paths = []
    for volume in service.get("volumes", []):
        source = volume.split(":")[0]
        if source.startswith("."):
            paths.append(ROOT / source)
    return paths


def _servers(compose: dict) -> dict[str, dict]:
    """The compose services that run tgi-py (built from the Dockerfile)."""
    return {name: service for name, service in compose["services"].items() if "build" in service}


def test_referenced_files_exist():
    compose = _compose()
    for name, service in compose["services"].items():
        for path in _host_paths(service):
            assert path.exists(), f"{name} mounts {path}, which does not exist"
        build = service.get("build")
        if build is not None:
            context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
            assert (context / "Dockerfile").exists()
    dockerfile = (ROOT / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                if not source.startswith("--"):
                    assert (ROOT / source).exists(), f"Dockerfile copies {source}"
    named = {v.split(":")[0] for s in compose["services"].values() for v in s.get("volumes", [])
             if not v.startswith(".")}
    assert named <= set(compose.get("volumes", {}))


@pytest.mark.skipif(shutil.which("docker") is None, reason="docker is not installed here: "
                    "docker-compose.yml is checked by the YAML tests of this module instead")
def test_docker_compose_config_accepts_the_file():
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("docker has no compose plugin here")
    result = subprocess.run(["docker", "compose", "--profile", "gpu", "config", "--quiet"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_launcher_commands_parse_and_ports_match():
    compose = _compose()
    for name in ("tgi", "tgi-cuda"):
        service = compose["services"][name]
        config = parse_args(service["command"])
        published = {int(p.split(":")[1]) for p in service["ports"]}
        assert published == {config.port, config.router["grpc_port"]}, name
        exposed = {int(p) for line in (ROOT / "Dockerfile").read_text().splitlines()
                   if line.startswith("EXPOSE ") for p in line.split()[1:]}
        assert published == exposed, "the image exposes what compose publishes"
        assert config.router["hostname"] == "0.0.0.0", "inside a container, listen on all addresses"
        endpoint = config.router["otlp_endpoint"]
        collector = compose["services"]["otel-collector"]
        host, port = endpoint.removeprefix("http://").split(":")
        assert host == "otel-collector"
        assert f"{port}:{port}" in collector["ports"]


def test_host_ports_are_distinct_across_profiles():
    """Every profile at once (`--profile gpu up`) binds each host port once."""
    host_ports = [p.split(":")[0] for service in _compose()["services"].values()
                  for p in service.get("ports", [])]
    assert len(host_ports) == len(set(host_ports)), host_ports


def test_model_caches_live_on_named_volumes():
    """The launcher's cache (TGI_PY_CACHE) and the Hub's (HF_HOME) are both kept on a volume, so
    a recreated container finds its models."""
    compose = _compose()
    for name, service in _servers(compose).items():
        mounts = {PurePosixPath(v.split(":")[1]) for v in service["volumes"]
                  if v.split(":")[0] in compose["volumes"]}
        for variable in ("TGI_PY_CACHE", "HF_HOME"):
            path = PurePosixPath(service["environment"][variable])
            assert any(path == mount or mount in path.parents for mount in mounts), \
                f"{name}: {variable}={path} is on no volume"


def test_gpu_services_get_shared_memory_for_nccl():
    gpu_services = [name for name, service in _compose()["services"].items()
                    if any("gpu" in device.get("capabilities", []) for device in
                           service.get("deploy", {}).get("resources", {}).get("reservations", {})
                           .get("devices", []))]
    assert gpu_services == ["tgi-cuda"]
    shm = _compose()["services"]["tgi-cuda"]["shm_size"]
    number, unit = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(shm).lower()).groups()
    assert int(number) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[unit] >= 2**30


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def _run_healthcheck(test: list[str], port: int, status: int) -> int:
    """The healthcheck's command, run here against a server answering `status` on /health, with
    a proxy in the environment that does not exist."""
    _Health.status = status
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert test[0] == "CMD" and test[1] == "python", "the image has Python, not curl"
        code = test[3].replace(f"127.0.0.1:{port}", f"127.0.0.1:{server.server_port}")
        proxy = "http://127.0.0.1:9"  # the discard port: a health check through it never answers
        env = {"PATH": "/usr/bin:/bin", "http_proxy": proxy, "HTTP_PROXY": proxy}
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              timeout=30).returncode
    finally:
        server.shutdown()
        server.server_close()


def test_healthchecks_ask_health_on_the_served_port():
    for name, service in _servers(_compose()).items():
        port = parse_args(service["command"]).port
        test = service["healthcheck"]["test"]
        assert f"http://127.0.0.1:{port}/health" in test[3], name
        assert _run_healthcheck(test, port, 200) == 0, f"{name}: healthy server reported unhealthy"
        assert _run_healthcheck(test, port, 503) != 0, f"{name}: a 503 passed the healthcheck"
        assert service["healthcheck"]["start_period"], "the first start fetches the model"


def test_prometheus_scrapes_every_server():
    compose = _compose()
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    scraped = {target for job in prometheus["scrape_configs"] if job["metrics_path"] == "/metrics"
               for group in job["static_configs"] for target in group["targets"]}
    servers = {f"{name}:{parse_args(service['command']).port}"
               for name, service in _servers(compose).items()}
    assert servers == {"tgi:8080", "tgi-cuda:8080"}
    assert servers <= scraped


def test_collector_receives_otlp_grpc_on_the_published_port():
    collector = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    endpoint = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert endpoint.endswith(":4317")
    assert "otlp" in collector["service"]["pipelines"]["traces"]["receivers"]


def test_collector_exports_traces_to_jaeger():
    compose = _compose()
    collector = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    exporters = collector["service"]["pipelines"]["traces"]["exporters"]
    viewers = []
    for exporter in exporters:
        assert exporter.split("/")[0] == "otlp", f"{exporter}: traces go to a viewer over OTLP"
        host, port = collector["exporters"][exporter]["endpoint"].split(":")
        viewers.append(compose["services"][host])
        assert port == "4317"
    assert [v["image"].split(":")[0] for v in viewers] == ["jaegertracing/all-in-one"]
    assert "16686:16686" in viewers[0]["ports"], "Jaeger's UI"


def test_third_party_images_are_pinned():
    for name, service in _compose()["services"].items():
        if "build" in service:
            continue
        image, _, tag = service["image"].rpartition(":")
        assert image and tag and tag != "latest", f"{name}: {service['image']} is not pinned"


# ---- deploy/kubernetes/ ---------------------------------------------------------------------------

def _manifests() -> list[dict]:
    documents = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        documents += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return documents


def _of_kind(kind: str) -> list[dict]:
    return [d for d in _manifests() if d["kind"] == kind]


def _pod_templates() -> list[tuple[str, dict, dict]]:
    """(role, pod template, values of the variables LWS sets) of every workload: role is
    `server` for a Deployment's pods, `leader` or `worker-<index>` in a LeaderWorkerSet's group."""
    templates = [("server", d["spec"]["template"], {}) for d in _of_kind("Deployment")]
    for lws in _of_kind("LeaderWorkerSet"):
        group = lws["spec"]["leaderWorkerTemplate"]
        size = group["size"]
        common = {"LWS_LEADER_ADDRESS": LEADER_ADDRESS, "LWS_GROUP_SIZE": str(size)}
        templates.append(("leader", group["leaderTemplate"], {**common, "LWS_WORKER_INDEX": "0"}))
        templates += [(f"worker-{index}", group["workerTemplate"],
                       {**common, "LWS_WORKER_INDEX": str(index)}) for index in range(1, size)]
    return templates


def _env_values(container: dict, injected: dict[str, str]) -> dict[str, str]:
    """The container's variables as the kubelet would set them, with stand-ins for the pod's IP
    and secrets."""
    values = dict(injected)
    for variable in container.get("env", []):
        source = variable.get("valueFrom", {})
        if "value" in variable:
            values[variable["name"]] = variable["value"]
        elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            values[variable["name"]] = "10.0.0.2"
        elif "secretKeyRef" in source:
            values[variable["name"]] = "secret"
    return values


def _launcher_config(container: dict, injected: dict[str, str]) -> LauncherConfig:
    """The container's args, expanded as Kubernetes expands $(VAR), parsed by the launcher."""
    assert "command" not in container, "the image's entrypoint (tgi-launcher) runs"
    env = _env_values(container, injected)

    def expand(match: re.Match) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) is set by nothing: Kubernetes would " \
                                      "pass it on unexpanded"
        return env[match.group(1)]

    args = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand, arg) for arg in container["args"]]
    # the pod's environment alone: the test machine's (HOSTNAME, PORT, ...) is not the pod's
    pod_environment = {"PATH": os.environ.get("PATH", ""), **env}
    try:
        with mock.patch.dict(os.environ, pod_environment, clear=True):
            return parse_args(args)
    except SystemExit:  # argparse's refusal, printed above
        pytest.fail(f"tgi-launcher refuses {args}")


def _validate(document: dict) -> None:
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(document, version, strict=True)


def test_kubernetes_manifests_validate_against_the_schemas():
    documents = _manifests()
    kinds = {d["kind"] for d in documents}
    assert {"Deployment", "Service", "PersistentVolumeClaim", "LeaderWorkerSet",
            "ServiceMonitor"} <= kinds
    for document in documents:
        if (document["apiVersion"], document["kind"]) in CRD_KINDS:
            continue
        _validate(document)


def test_leaderworkerset_is_well_formed():
    """Its fields as LWS's API declares them (api/leaderworkerset/v1), its pod templates as
    Kubernetes' PodTemplateSpec."""
    (lws,) = _of_kind("LeaderWorkerSet")
    assert set(lws) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(lws["spec"]) <= {"replicas", "leaderWorkerTemplate", "rolloutStrategy",
                                "startupPolicy", "networkConfig"}
    group = lws["spec"]["leaderWorkerTemplate"]
    assert set(group) <= {"leaderTemplate", "workerTemplate", "size", "restartPolicy",
                          "subGroupPolicy", "volumeClaimTemplates",
                          "persistentVolumeClaimRetentionPolicy"}
    assert isinstance(group["size"], int) and group["size"] >= 2
    # a rank that dies ends its launcher, which cannot restart ranks split across machines
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    for name in ("leaderTemplate", "workerTemplate"):
        _validate({"apiVersion": "v1", "kind": "PodTemplate",
                   "metadata": {"name": f"{lws['metadata']['name']}-{name}"},
                   "template": group[name]})


def test_launcher_args_parse_in_every_pod():
    for role, template, injected in _pod_templates():
        for container in template["spec"]["containers"]:
            config = _launcher_config(container, injected)
            assert config.router.get("hostname") in (None, "0.0.0.0"), role


def test_probes_ask_health_on_the_http_port():
    for role, template, injected in _pod_templates():
        (container,) = template["spec"]["containers"]
        config = _launcher_config(container, injected)
        if config.node_rank > 0:  # no router there
            assert not any(f"{kind}Probe" in container for kind in ("startup", "readiness",
                                                                     "liveness")), role
            continue
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        for kind in ("startup", "readiness", "liveness"):
            probe = container[f"{kind}Probe"]["httpGet"]
            assert probe["path"] == "/health", (role, kind)
            assert ports.get(probe["port"], probe["port"]) == config.port, (role, kind)
        # the first start fetches and loads the model for many minutes before the port opens
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60
        # a shard group's restart (a 503 meanwhile) must not get the pod killed
        liveness = container["livenessProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 120


def test_pods_keep_their_model_cache_on_a_volume():
    claims = {d["metadata"]["name"] for d in _of_kind("PersistentVolumeClaim")}
    for role, template, injected in _pod_templates():
        (container,) = template["spec"]["containers"]
        env = _env_values(container, injected)
        mounts = {PurePosixPath(m["mountPath"]): m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        for variable in ("TGI_PY_CACHE", "HF_HOME"):
            path = PurePosixPath(env[variable])
            (volume,) = [name for mount, name in mounts.items()
                         if mount == path or mount in path.parents]
            if role == "server":  # a Deployment's cache outlives its pods
                assert volumes[volume]["persistentVolumeClaim"]["claimName"] in claims, role


def test_gpu_pods_get_a_gpu_per_local_shard_and_shared_memory():
    for role, template, injected in _pod_templates():
        (container,) = template["spec"]["containers"]
        config = _launcher_config(container, injected)
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        if config.device == "cpu":
            assert gpus is None and container["image"].endswith(":cpu"), role
            continue
        assert config.device == "cuda" and container["image"].endswith(":cuda"), role
        assert gpus == len(config.local_ranks), role
        shm = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (volume,) = [v for v in template["spec"]["volumes"] if [v["name"]] == shm]
        assert volume["emptyDir"]["medium"] == "Memory", role


def test_services_reach_the_router_ports():
    """Each Service selects pods that run a router, and its ports are the router's."""
    routers = []
    for role, template, injected in _pod_templates():
        (container,) = template["spec"]["containers"]
        config = _launcher_config(container, injected)
        if config.node_rank == 0:
            routers.append((template["metadata"]["labels"], container, config))
    for service in _of_kind("Service"):
        selector = service["spec"]["selector"]
        selected = [(container, config) for labels, container, config in routers
                    if selector.items() <= labels.items()]
        assert selected, f"{service['metadata']['name']} selects no router"
        for container, config in selected:
            ports = {port["name"]: port["containerPort"] for port in container["ports"]}
            expected = {"http": config.port, "grpc": config.router["grpc_port"],
                        "metrics": config.router["prometheus_port"]}
            for port in service["spec"]["ports"]:
                assert ports[port["targetPort"]] == expected[port["name"]] == port["port"]


def test_leaderworkerset_group_agrees_with_the_launchers():
    (lws,) = _of_kind("LeaderWorkerSet")
    configs = {role: _launcher_config(template["spec"]["containers"][0], injected)
               for role, template, injected in _pod_templates() if role != "server"}
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    assert sorted(config.node_rank for config in configs.values()) == list(range(size))
    for role, config in configs.items():
        assert config.nnodes == size, role
        assert config.master_addr == LEADER_ADDRESS, f"{role}: torch.distributed meets elsewhere"
        assert config.node_address == "10.0.0.2", f"{role}: the leader reaches it at its pod IP"
        assert config.num_shard == configs["leader"].num_shard, role
    # LWS names its headless Service (the pods' DNS names) after the set: ours must not take it
    names = {service["metadata"]["name"] for service in _of_kind("Service")}
    assert lws["metadata"]["name"] not in names
    worker_labels = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
    for service in _of_kind("Service"):
        assert not service["spec"]["selector"].items() <= worker_labels.items(), \
            "workers run no router"


def test_prometheus_finds_every_router():
    """By the pods' prometheus.io annotations, and by the ServiceMonitor of the Prometheus
    Operator."""
    for role, template, injected in _pod_templates():
        (container,) = template["spec"]["containers"]
        config = _launcher_config(container, injected)
        annotations = template["metadata"].get("annotations", {})
        if config.node_rank > 0:
            assert "prometheus.io/scrape" not in annotations, role
            continue
        assert annotations["prometheus.io/scrape"] == "true", role
        assert annotations["prometheus.io/port"] == str(config.router["prometheus_port"]), role
        assert annotations["prometheus.io/path"] == "/metrics", role
    (monitor,) = _of_kind("ServiceMonitor")
    assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [s for s in _of_kind("Service") if selector.items() <= s["metadata"]["labels"].items()]
    assert len(services) == len(_of_kind("Service")), "every router's Service is scraped"
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["path"] == "/metrics"
        for service in services:
            assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
