"""docker-compose.yml and the Dockerfile agree with the files and the launcher's flags (Docker cannot
run here, so the references are checked statically)."""
from pathlib import Path

import yaml

from launcher.config import parse_args

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _host_paths(service: dict) -> list[Path]:
    paths = []
    for volume in service.get("volumes", []):
        source = volume.split(":")[0]
        if source.startswith("."):
            paths.append(ROOT / source)
    return paths


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
                assert (ROOT / source).exists(), f"Dockerfile copies {source}"
    named = {v.split(":")[0] for s in compose["services"].values() for v in s.get("volumes", [])
             if not v.startswith(".")}
    assert named <= set(compose.get("volumes", {}))


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


def test_prometheus_scrapes_the_server_metrics():
    compose = _compose()
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    job = prometheus["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    port = parse_args(compose["services"]["tgi"]["command"]).port
    assert job["static_configs"][0]["targets"] == [f"tgi:{port}"]


def test_collector_receives_otlp_grpc_on_the_published_port():
    collector = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    endpoint = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert endpoint.endswith(":4317")
    assert "otlp" in collector["service"]["pipelines"]["traces"]["receivers"]
