"""The colocated deployment (no prefill pool, as vLLM serves): its routing policies, the scheduler that needs only
decode instances, the settings, topology and `tsukimi up` flags that refuse a prefill pool or a Conductor, and when
`tsukimi up` runs it by default."""

from __future__ import annotations

import time

import pytest

from services.scheduler.cost_model import DecodeCostModel, PrefillCostModel
from services.scheduler.estimates import ClusterView, Tracked
from services.scheduler.index import BlockIndex
from services.scheduler.policies import ColocatedPolicy, make_policy
from services.scheduler.service import SchedulerService
from shared.config import ConfigError, load_settings
from shared.tools.cli import up
from shared.tools.cli.main import build_parser, main
from shared.tools.topology import SERVICES_BY_NAME, Topology, TopologyError
from shared.wire.protocol import Heartbeat, Message, PrefillTask, Role, SamplingParams, Subjects, SubmitRequest

NOW = 1_000_000.0


def beat(instance_id: str, running: int = 0, waiting: int = 0, blocks_used: int = 0) -> Heartbeat:
    return Heartbeat(instance_id, Role.DECODE, epoch=1, sent_at=NOW - 1.0, num_running=running, num_waiting=waiting,
                     kv_blocks_used=blocks_used)


def view(*decodes: Heartbeat, tracked: dict[str, Tracked] | None = None) -> ClusterView:
    return ClusterView(prefills=[], decodes=list(decodes), store_ids=[], index=BlockIndex(),
                       prefill_cost=PrefillCostModel(), decode_cost=DecodeCostModel(), tracked=tracked or {},
                       block_size=64, balance_ratio=2.0, now=NOW)


def submit(request_id: str, num_tokens: int = 100) -> SubmitRequest:
    return SubmitRequest(request_id, list(range(num_tokens)), [], SamplingParams(max_tokens=8), NOW)


def placed_on(instance_id: str, request_id: str) -> Tracked:
    """A placement made after the instance's last heartbeat (so the beat does not count it yet)."""
    return Tracked(request_id, instance_id, instance_id, 100, 0.1, NOW, NOW + 1, NOW + 2)


def test_round_robin_cycles_over_the_instances_and_each_prefills_its_own() -> None:
    policy = make_policy("round_robin", local_prefill_tokens=0, tbt_slo_s=0.1, colocated=True)
    assert isinstance(policy, ColocatedPolicy) and policy.name == "colocated_round_robin"
    cluster = view(beat("d0"), beat("d1"), beat("d2"))
    placements = [policy.place(submit(f"r{i}", 300), cluster) for i in range(7)]
    assert [p.decode_id for p in placements] == ["d0", "d1", "d2", "d0", "d1", "d2", "d0"]
    for p in placements:
        assert p.on_decode and p.prefill.instance_id == p.decode_id
        assert not p.prefill.fetch_from_pool and p.prefill.num_reused_blocks == 0
        assert p.prefill.compute_s == pytest.approx(cluster.prefill_cost.predict(300, 0))
        assert p.tbt_s == pytest.approx(cluster.tbt_s(beat(p.decode_id), None, 300))


def test_least_loaded_picks_the_fewest_sequences_counting_placements_since_the_heartbeat() -> None:
    policy = make_policy("least_loaded", 0, 0.1, colocated=True)
    beats = (beat("d0", running=2), beat("d1"), beat("d2", running=1))
    first = policy.place(submit("r1"), view(*beats))
    assert first.decode_id == first.prefill.instance_id == "d1" and first.on_decode
    since = {f"x{i}": placed_on("d1", f"x{i}") for i in range(3)}  # d1 now holds 3, d2 1, d0 2
    assert policy.place(submit("r2"), view(*beats, tracked=since)).decode_id == "d2"
    waiting = (beat("d0", running=1, waiting=3), beat("d1", running=2, blocks_used=5), beat("d2", running=2))
    assert policy.place(submit("r3"), view(*waiting)).decode_id == "d2"  # waiting counts; ties: fewer blocks used


def test_random_routing_stays_on_the_instances_and_repeats_with_a_seed() -> None:
    cluster = view(beat("d0"), beat("d1"), beat("d2"))

    def draws(seed: int) -> list[str]:
        policy = ColocatedPolicy("random", seed=seed)
        return [policy.place(submit(f"r{i}"), cluster).decode_id for i in range(60)]

    assert draws(3) == draws(3) != draws(4)
    assert set(draws(3)) == {"d0", "d1", "d2"}


def test_the_policy_seed_setting_reaches_the_random_choices() -> None:
    settings = load_settings("scheduler", {"TSUKIMI_POLICY_SEED": "3"})
    assert settings.policy_seed == 3 and load_settings("scheduler", {}).policy_seed is None
    cluster = view(beat("d0"), beat("d1"), beat("d2"))

    def draws() -> list[str]:
        policy = make_policy("random", 0, 0.1, colocated=True, seed=settings.policy_seed)
        return [policy.place(submit(f"r{i}"), cluster).decode_id for i in range(60)]

    assert draws() == draws()


def test_a_route_that_needs_a_prefill_pool_is_refused() -> None:
    for name in ("conductor", "local_cache_aware"):
        with pytest.raises(ValueError, match="colocated deployment routes with"):
            make_policy(name, 0, 0.1, colocated=True)
    assert make_policy("conductor", 0, 0.1).name == "conductor"  # fine with a prefill pool


class RecordingBus:
    """What SchedulerService uses of the bus: `subjects` and `publish`."""

    def __init__(self) -> None:
        self.subjects = Subjects("t")
        self.published: list[tuple[str, Message]] = []

    async def publish(self, subject: str, msg: Message) -> None:
        self.published.append((subject, msg))


async def test_a_colocated_scheduler_needs_only_decode_instances() -> None:
    settings = load_settings("scheduler", {"TSUKIMI_DEPLOYMENT": "colocated", "TSUKIMI_POLICY": "least_loaded",
                                           "TSUKIMI_REJECTION": "off"})
    bus = RecordingBus()
    scheduler = SchedulerService(settings, bus)  # type: ignore[arg-type]
    reply = await scheduler.handle_submit(submit("r0"))
    assert not reply.accepted and reply.reason_code == "no_decode"  # not no_prefill: there is no prefill pool
    for b in (beat("d0", running=1), beat("d1")):
        await scheduler.handle_heartbeat(b)
    reply = await scheduler.handle_submit(SubmitRequest("r1", list(range(50)), [], SamplingParams(), time.time()))
    assert reply.accepted and reply.prefill_id == reply.decode_id == "d1"
    (subject, task), = bus.published
    assert subject == bus.subjects.decode_run("d1")
    assert isinstance(task, PrefillTask) and task.request_id == "r1" and task.decode_id == "d1"


def test_settings_refuse_a_colocated_conductor() -> None:
    with pytest.raises(ConfigError, match="TSUKIMI_POLICY=conductor needs a prefill pool"):
        load_settings("scheduler", {"TSUKIMI_DEPLOYMENT": "colocated", "TSUKIMI_POLICY": "conductor"})
    settings = load_settings("scheduler", {"TSUKIMI_DEPLOYMENT": "colocated", "TSUKIMI_POLICY": "least_loaded"})
    assert settings.deployment == "colocated" and settings.policy == "least_loaded"
    assert load_settings("scheduler", {}).deployment == "disaggregated"
    with pytest.raises(ConfigError, match="TSUKIMI_DEPLOYMENT"):
        load_settings("scheduler", {"TSUKIMI_DEPLOYMENT": "split"})


def test_a_colocated_topology_runs_decode_instances_only() -> None:
    topology = Topology(colocated=True, prefill=0, decode=3)
    specs = topology.process_specs(python="python")
    names = [s.name for s in specs]
    assert [n for n in names if n.startswith("decode-")] == ["decode-0", "decode-1", "decode-2"]
    assert not [n for n in names if n.startswith("prefill")]
    assert {"gateway-0", "scheduler-0", "cache-store-0"} <= set(names)
    assert all(s.env["TSUKIMI_DEPLOYMENT"] == "colocated" for s in specs)
    assert topology.count(SERVICES_BY_NAME["prefill"]) == 0
    assert "TSUKIMI_DEPLOYMENT" not in Topology().service_env(SERVICES_BY_NAME["decode"])


def test_a_colocated_topology_refuses_a_prefill_pool_or_no_decode() -> None:
    with pytest.raises(TopologyError, match="no prefill pool"):
        Topology(colocated=True, prefill=1, decode=2)
    with pytest.raises(TopologyError, match="decode must be at least 1"):
        Topology(colocated=True, prefill=0, decode=0)
    with pytest.raises(TopologyError, match="prefill must be at least 1"):
        Topology(prefill=0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["up", "--colocated", "2", "--prefill", "1"], "--colocated N replaces --prefill and --decode"),
        (["up", "--colocated", "2", "--decode", "3"], "--colocated N replaces --prefill and --decode"),
        (["up", "--colocated", "0"], "must be a positive integer"),
        (["up", "--colocated", "2", "--policy", "conductor"], "needs a prefill pool"),
        (["up", "--profile", "llama3-70b-8xa800"], "--profile needs --engine sim"),
        (["up", "--engine", "sim", "--profile", "gpt-5"], "invalid choice"),
    ],
)
def test_up_refuses_contradictory_deployment_flags(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TSUKIMI_POLICY", raising=False)
    monkeypatch.delenv("TSUKIMI_DEPLOYMENT", raising=False)
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, env, on_cpu, colocated",
    [
        ([], {}, True, True),  # the model on the CPU, nothing asked for: two colocated instances
        ([], {}, False, False),  # a GPU: Mooncake's prefill and decode pools
        (["--prefill", "1", "--decode", "1"], {}, True, False),
        (["--decode", "2"], {}, True, False),
        (["--cpp-group", "2"], {}, True, False),
        (["--colocated", "3"], {}, True, False),  # asked for: left as given
        (["--policy", "conductor"], {}, True, False),  # needs a prefill pool
        ([], {"TSUKIMI_POLICY": "conductor"}, True, False),
        (["--policy", "round_robin"], {}, True, True),
        ([], {"TSUKIMI_DEPLOYMENT": "disaggregated"}, True, False),
        (["--engine", "sim"], {}, True, False),  # it stands for GPU clusters
        ([], {"TSUKIMI_ENGINE": "sim"}, True, False),
    ],
)
def test_up_runs_colocated_instances_by_default_where_the_model_runs_on_the_cpu(
    argv: list[str], env: dict[str, str], on_cpu: bool, colocated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("TSUKIMI_POLICY", "TSUKIMI_DEPLOYMENT", "TSUKIMI_ENGINE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(up, "_engines_on_cpu", lambda: on_cpu)
    args = build_parser().parse_args(["up", *argv])
    assert up._colocated_by_default(args) is colocated


def test_the_device_setting_says_whether_the_engines_run_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TSUKIMI_DEVICE", "cpu")
    assert up._engines_on_cpu()
    monkeypatch.setenv("TSUKIMI_DEVICE", "cuda:1")
    assert not up._engines_on_cpu()
