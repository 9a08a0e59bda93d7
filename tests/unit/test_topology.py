"""One topology for `tsukimi up` and docker compose: the committed compose file is the generated one, names only real
settings and modules, and local process specs get unique ids and shard indices."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.cli.compose import render_compose, to_yaml
from shared.config import ENV_VARS
from shared.topology import SERVICES, Topology, TopologyError, compose_document, compose_topology, module_file

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
    assert services["prefill"]["deploy"] == {"replicas": 1} and services["decode"]["deploy"] == {"replicas": 1}
    assert services["cache-store-0"]["volumes"] == ["cache-store-0-ssd:/var/lib/tsukimi/ssd"]


def test_compose_names_only_known_settings_and_no_instance_id() -> None:
    for name, service in committed_compose()["services"].items():
        env = service.get("environment", {})
        assert set(env) <= set(ENV_VARS), name
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
    specs = Topology(cache_stores=2, cache_ssd_dir="/ssd", engine_threads=3, model="/m.gguf").process_specs()
    ssd = {spec.name: spec.env.get("TSUKIMI_CACHE_SSD_DIR") for spec in specs if spec.name.startswith("cache-store")}
    assert ssd == {"cache-store-0": "/ssd/shard-0", "cache-store-1": "/ssd/shard-1"}
    threads = {spec.name: spec.env.get("TSUKIMI_NUM_THREADS") for spec in specs}
    assert threads["prefill-0"] == threads["decode-0"] == "3" and threads["gateway-0"] is None
    assert all(spec.env["TSUKIMI_MODEL"] == "/m.gguf" for spec in specs)
    assert Topology(cache_ssd_dir="/ssd").process_specs()[-1].env["TSUKIMI_CACHE_SSD_DIR"] == "/ssd"


@pytest.mark.parametrize("kwargs", [{"prefill": 0}, {"decode": -1}, {"cache_stores": 0}, {"port": 0}])
def test_a_topology_that_cannot_run_is_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(TopologyError):
        Topology(**kwargs)  # type: ignore[arg-type]
