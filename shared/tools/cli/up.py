"""`tsukimi up`: the whole system as local processes (an embedded nats-server plus every service of
`shared.tools.topology`) under `shared.tools.supervisor`, until Ctrl-C or SIGTERM. It owns the checks before start
and the waiting.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import tempfile
from pathlib import Path

from shared.config import (
    COLOCATED_POLICIES,
    ENGINES,
    POLICIES,
    REJECTION_MODES,
    ClusterSettings,
    ConfigError,
    check_http_exposure,
    load_role_settings,
)
from shared.engine.config import KV_POLICIES, cpu_native_dtype
from shared.model.dummy import dummy_manifest_parts, is_dummy
from shared.sim.manifest import sim_model_name
from shared.sim.profiles import PROFILES, SIM_ENV_DEFAULTS, get_profile
from shared.tools.cli.common import CliError, add_kv_codec_args, positive_int
from shared.tools.cli.secrets import LocalSecrets
from shared.tools.cli.up_session import Session, say, stop_on_signals
from shared.tools.nats_server import NatsServerError, find_nats_server, free_port
from shared.tools.supervisor import Supervisor
from shared.tools.topology import SERVICES, Topology, TopologyError, module_file, nats_process_spec
from shared.wire.api_keys import ApiKeysError, load_api_keys
from shared.wire.log import redact_url
from shared.wire.protocol import Subjects
from shared.wire.secrets import ROLES, Secrets, SecretsError

DESCRIPTION = """\
Run tsukimi on this machine: an embedded nats-server (unless --nats-url is given), then the gateway, the scheduler,
N prefill, N decode and N cache-store shards, each a `python -m services.<name>` process. When the gateway's
GET /health answers 200 it prints the API's URL. Ctrl-C (or SIGTERM) stops everything within 10 s.

Which engines: where the model runs on this machine's CPU (no NVIDIA GPU, or TSUKIMI_DEVICE=cpu) and no topology is
given, 2 colocated instances, each prefilling and decoding its own requests on half the cores (as --colocated 2).
On a CPU prefill and decode share the cores and the memory bandwidth whatever the topology, and two such instances
keep both busy, where a prefill/decode pair leaves prefill's core idle while decode is the bottleneck (2-core Xeon,
32 streams, two runs: 1.26x-1.37x the pair's output rate; docs/experiments/peers.md). --prefill N --decode N
run Mooncake's disaggregated pools (the default with a GPU, with --engine sim, or with the conductor policy), which
pay where prefill and decode get hardware of their own.

Each process writes its output to DIR/<instance>.log (--log-dir; default: a new temporary folder, printed at start);
the terminal shows only what needs attention. A process that exits is restarted after 0.5 s, doubling up to 10 s
(reset once it has stayed up for 30 s).

Every process gets TSUKIMI_NATS_URL, TSUKIMI_CACHE_SHARDS and its own TSUKIMI_INSTANCE_ID (gateway-0, prefill-1,
...); the gateway gets TSUKIMI_HOST and TSUKIMI_PORT, cache-store i gets TSUKIMI_CACHE_SHARD=i, prefill and decode
share the CPU cores (TSUKIMI_NUM_THREADS) and half the memory available for their KV pools
(TSUKIMI_KV_MEMORY_FRACTION) unless they are set, and prompts of up to 512 tokens may be prefilled on the decode
instance where the Conductor predicts that faster within the TBT SLO (TSUKIMI_LOCAL_PREFILL_TOKENS=512, the
default elsewhere 128: the prefill instance has only its share of this machine's cores); with several shards a
TSUKIMI_CACHE_SSD_DIR becomes one shard-<i> folder each; with --cpp-group N each prefill instance gets
TSUKIMI_CPP_GROUP, the ids of its group (prefill-0..N-1, then prefill-N..2N-1, ...). Every other TSUKIMI_*
variable of this shell is passed through (an unknown one is an error). The same topology in containers: `tsukimi
compose`.

Simulation (`--engine sim --profile llama3-70b-8xa800`): the same services, NATS, scheduler and cache-store, but no
model runs: each prefill and decode step sleeps for the time a roofline model of that model on those GPUs predicts
(shared/sim/profiles.py holds every constant and its source) and KV travels as sizes only, so one machine can stand
in for a cluster of 70B-model nodes. The model id it serves ends in `-sim`. Unless set, it uses 512-token blocks, up
to 256 sequences a batch and 1 TiB of cache-store DRAM a shard. `--colocated N` runs the vLLM-style baseline.

Exit status: 0 after Ctrl-C or SIGTERM, 1 when the system did not come up in time, 2 for a bad argument or setting.
"""
KV_MEMORY_SHARED = 0.5  # the share of available memory the engines' auto-sized KV pools take together
# On one machine the prefill instance has only its share of the cores: prompts of up to one 512-token step may be
# computed where they decode, whenever the Conductor predicts that faster and within the TBT SLO (on a 2-core EPYC,
# 32 streams: TTFT p50 8.5 -> 0.8 s, 52 -> 108 of 128 requests within both SLOs; docs/experiments/peers.md).
LOCAL_PREFILL_TOKENS_ONE_MACHINE = 512
# Where the engines compute on this machine's CPU, prefill and decode share its cores and memory bandwidth whatever
# the topology; two colocated instances (each prefilling and decoding, a half of the cores each) then keep both cores
# on the work at hand, where a prefill/decode pair leaves the prefill core idle while decode is the bottleneck (2-core
# Xeon with AMX, 32 streams, two runs: 349 and 366 against 276 and 266 output tok/s, vLLM 289 and 268;
# docs/experiments/peers.md).
# Disaggregation pays where prefill and decode get hardware of their own: GPUs, or several machines.
CPU_DEFAULT_COLOCATED = 2
STOP_SERVICES_S = 6.5  # SIGTERM grace of the services; NATS goes last with STOP_NATS_S: 8 s in all, then SIGKILL
STOP_NATS_S = 1.5


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "up", help="run the whole system locally (OpenAI-compatible API)", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--prefill", type=positive_int, metavar="N",
                        help="prefill instances (default: 1; none on a CPU: see above)")
    parser.add_argument("--decode", type=positive_int, metavar="N",
                        help="decode instances (default: 1; none on a CPU: see above)")
    parser.add_argument(
        "--colocated", type=positive_int, metavar="N",
        help="instead of prefill and decode pools, N instances that each prefill (chunked, with their own prefix "
             "cache) and decode their requests, as vLLM serves; route with --policy round_robin, least_loaded or "
             "random (default on a CPU: 2, least_loaded)",
    )
    parser.add_argument(
        "--cpp-group", type=positive_int, metavar="N",
        help="prefill instances per pipeline group (chunked pipeline parallelism): each group computes a prompt of "
             "at least TSUKIMI_CPP_MIN_TOKENS new tokens as N stages of the model's layers, chunk after chunk; "
             "--prefill must be a multiple of N (default: 1, no groups)",
    )
    parser.add_argument(
        "--cache-stores", type=positive_int, default=1, metavar="N", help="cache-store shards (default: 1)"
    )
    parser.add_argument("--host", help="gateway listen address (default: $TSUKIMI_HOST or 127.0.0.1); beyond loopback "
                                       "it needs API keys (TSUKIMI_API_KEYS_FILE, see `tsukimi keys`) or --insecure")
    parser.add_argument("--insecure", action="store_true",
                        help="serve a non-loopback --host without API keys: anyone who reaches the port is served "
                             "(TSUKIMI_INSECURE_HTTP=on)")
    parser.add_argument("--port", type=int, help="gateway port (default: $TSUKIMI_PORT or 8000)")
    parser.add_argument(
        "--model", metavar="PATH", help="a GGUF file or safetensors folder (default: SmolLM2-135M-Instruct); "
        "dummy:NAME serves random weights at a shipped shape (llama-3-8b, llama-3-70b, tiny) to measure speed"
    )
    parser.add_argument("--nats-url", metavar="URL", help="use this NATS server instead of starting one")
    parser.add_argument(
        "--nats-secrets", metavar="FILE", type=Path,
        help="with --nats-url: the deployment's secrets (`tsukimi secrets`; the server configured with `tsukimi "
             "nats config`); without it the services connect as the TSUKIMI_NATS_* variables say")
    parser.add_argument(
        "--log-dir", metavar="DIR", type=Path, help="where each process's log goes (default: a new temp dir)"
    )
    sim = parser.add_argument_group("engine")
    sim.add_argument("--engine", choices=ENGINES,
                     help="real: run the model; sim: no model runs, each engine step sleeps for the time a roofline "
                          "model of --profile predicts, and KV travels as sizes only (TSUKIMI_ENGINE)")
    sim.add_argument("--profile", choices=sorted(PROFILES),
                     help="model and GPUs the sim engine stands for (TSUKIMI_SIM_PROFILE; default llama3-70b-8xa800)")
    add_kv_codec_args(sim, default=None)
    sim.add_argument("--kv-policy", choices=KV_POLICIES,
                     help="full: keep every token's KV; fastgen: profile each prompt's attention per KV head and keep "
                          "only what the head's policy needs (see README, FastGen); with a kvquant --kv-codec its "
                          "lanes hold kvquant records (TSUKIMI_KV_POLICY)")
    sim.add_argument("--fastgen-threshold", type=float, metavar="T",
                     help="FastGen's T: the attention mass each head's policy must recover, in (0, 1]; 1 keeps every "
                          "token (TSUKIMI_FASTGEN_T; default 0.95)")
    slo = parser.add_argument_group("scheduling (default: the TSUKIMI_* variables, else conductor, 10000 ms, 500 ms)")
    slo.add_argument("--policy", choices=POLICIES, help="placement policy (TSUKIMI_POLICY)")
    slo.add_argument("--slo-ttft-ms", type=float, metavar="MS",
                     help="time-to-first-token SLO: requests predicted to miss it get HTTP 429 (TSUKIMI_SLO_TTFT_MS)")
    slo.add_argument("--slo-tbt-ms", type=float, metavar="MS",
                     help="time-between-tokens SLO, judged on the decode instance (TSUKIMI_SLO_TBT_MS)")
    slo.add_argument("--rejection", choices=REJECTION_MODES,
                     help="early rejection: off, on current load, or on decode load predicted for when the request "
                          "reaches decode (TSUKIMI_REJECTION; default predicted)")
    parser.add_argument(
        "--startup-timeout", type=float, default=180.0, metavar="S",
        help="give up (exit 1) when /health is not 200 after this many seconds (default: 180)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.startup_timeout <= 0:
        raise CliError(f"--startup-timeout must be positive, got {args.startup_timeout}")
    if _colocated_by_default(args):
        args.colocated = CPU_DEFAULT_COLOCATED
        say(f"{CPU_DEFAULT_COLOCATED} colocated instances: the default where the model runs on the CPU (disaggregated "
            "pools: --prefill 1 --decode 1)")
    overrides = _scheduling_env(args) | _deployment_env(args)
    settings = _environment_settings(overrides)
    topology = dataclasses.replace(_topology(args, settings), extra_env=tuple(sorted(overrides.items())))
    _check_exposure(topology.host, settings)
    _check_port_free(topology.host, topology.port)
    _check_modules()
    nats_binary = None if args.nats_url else _nats_binary()
    log_dir = (args.log_dir or Path(tempfile.mkdtemp(prefix="tsukimi-"))).resolve()
    auth = _local_auth(args)
    try:
        return _run(args, settings, topology, nats_binary, log_dir, auth)
    finally:
        if auth is not None:
            auth.close()


def _run(
    args: argparse.Namespace, settings: ClusterSettings, topology: Topology, nats_binary: str | None, log_dir: Path,
    auth: LocalSecrets | None,
) -> int:
    infra_specs, nats_port = [], None
    if auth is not None:
        files = tuple((role, str(auth.password_file(role))) for role in ROLES)
        topology = dataclasses.replace(topology, nats_password_files=files, block_key_file=str(auth.block_key_file))
    if nats_binary is not None:
        assert auth is not None
        nats_port = free_port()
        topology = dataclasses.replace(topology, nats_url=f"nats://127.0.0.1:{nats_port}")
        config = auth.server_config_file(nats_port, Subjects(settings.subject_prefix))
        infra_specs.append(nats_process_spec(nats_binary, config))
    counts = ", ".join(f"{count} {s.name}" for s in SERVICES if (count := topology.count(s)))
    access = "a password per role" if auth is not None else "the TSUKIMI_NATS_* credentials"
    say(f"starting {counts} on NATS {redact_url(topology.nats_url)} ({access}); logs in {log_dir}")
    if settings.engine_kind == "real":
        say(f"weights and KV in {settings.engine.dtype} (TSUKIMI_DTYPE; by default bf16 where the CPU computes bf16)")
    if auth is None and not settings.nats_credentials.password and "@" not in topology.nats_url:
        say("WARNING: connecting to NATS without credentials: whoever reaches it reads and forges every message "
             "(see --nats-secrets)")
    model_name = args.model if is_dummy(args.model) else settings.model_name
    if is_dummy(args.model):
        say(f"RANDOM WEIGHTS: {args.model} has the shape of a real model and none of its knowledge (for measuring)")
    if settings.engine_kind == "sim":
        profile = get_profile(settings.sim_profile)
        model_name = sim_model_name(profile)
        say(f"SIMULATION: no model runs; engine steps sleep for a roofline model of {profile.model.num_layers}-layer "
             f"{profile.name} ({profile.num_gpus}x {profile.gpu.name} per instance), KV moves as sizes only")
    with stop_on_signals() as stop:
        session = Session(
            topology, model_name, args.startup_timeout, stop,
            infra=Supervisor(infra_specs, log_dir, say=say),
            services=Supervisor(topology.process_specs(), log_dir, say=say), nats_port=nats_port,
            needs_key=settings.api_keys_file is not None,
        )
        try:
            return session.serve()
        finally:
            say("stopping")
            session.services.stop(STOP_SERVICES_S)
            session.infra.stop(STOP_NATS_S)
            say("stopped")


def _local_auth(args: argparse.Namespace) -> LocalSecrets | None:
    """The passwords this run's processes connect with: new ones for the embedded server, those of --nats-secrets for
    an existing one, or none (the services then connect as their TSUKIMI_NATS_* variables say)."""
    if args.nats_secrets and not args.nats_url:
        raise CliError("--nats-secrets goes with --nats-url (the embedded server gets new passwords every run)")
    if args.nats_url and not args.nats_secrets:
        return None
    try:
        secrets = Secrets.read(args.nats_secrets) if args.nats_secrets else Secrets.generate()
    except SecretsError as exc:
        raise CliError(str(exc)) from None
    return LocalSecrets.create(secrets)


def _environment_settings(overrides: dict[str, str]) -> ClusterSettings:
    """This shell's TSUKIMI_* variables and the flags' overrides, checked now: every child would fail on a bad one."""
    try:
        return load_role_settings(ClusterSettings, "up", overrides=overrides)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def _scheduling_env(args: argparse.Namespace) -> dict[str, str]:
    """The scheduling flags given, as the variables every service reads."""
    flags = {"TSUKIMI_POLICY": args.policy, "TSUKIMI_SLO_TTFT_MS": args.slo_ttft_ms,
             "TSUKIMI_SLO_TBT_MS": args.slo_tbt_ms, "TSUKIMI_REJECTION": args.rejection}
    return {name: str(value) for name, value in flags.items() if value is not None}


def _deployment_env(args: argparse.Namespace) -> dict[str, str]:
    """--engine, --profile, --colocated and --insecure as variables; a sim system also gets `SIM_ENV_DEFAULTS`, a
    colocated one the least_loaded routing, and a real one bf16 weights and KV where the CPU computes bf16
    (`cpu_native_dtype`) and prompts of up to `LOCAL_PREFILL_TOKENS_ONE_MACHINE` tokens computed on decode where the
    Conductor predicts that better, where neither the flags nor this shell say otherwise."""
    if args.profile and args.engine != "sim":
        raise CliError("--profile needs --engine sim")
    env = {}
    if args.engine != "sim" and "TSUKIMI_DTYPE" not in os.environ:  # a shell's choice wins
        env["TSUKIMI_DTYPE"] = cpu_native_dtype()
    if args.engine != "sim" and "TSUKIMI_LOCAL_PREFILL_TOKENS" not in os.environ:
        env["TSUKIMI_LOCAL_PREFILL_TOKENS"] = str(LOCAL_PREFILL_TOKENS_ONE_MACHINE)
    if args.engine == "sim":
        env = {name: value for name, value in SIM_ENV_DEFAULTS.items() if name not in os.environ}
        env["TSUKIMI_ENGINE"] = "sim"
    if args.profile:
        env["TSUKIMI_SIM_PROFILE"] = args.profile
    if args.kv_codec:
        env["TSUKIMI_KV_CODEC"] = args.kv_codec
    if args.kv_calib:
        env["TSUKIMI_KV_CALIB"] = str(Path(args.kv_calib).resolve())
    if args.kv_policy:
        env["TSUKIMI_KV_POLICY"] = args.kv_policy
    if args.fastgen_threshold is not None:
        env["TSUKIMI_FASTGEN_T"] = str(args.fastgen_threshold)
    if args.insecure:
        env["TSUKIMI_INSECURE_HTTP"] = "on"
    if args.colocated:
        env["TSUKIMI_DEPLOYMENT"] = "colocated"
        if args.policy is None and "TSUKIMI_POLICY" not in os.environ:
            env["TSUKIMI_POLICY"] = "least_loaded"
    return env


def _colocated_by_default(args: argparse.Namespace) -> bool:
    """No topology asked for (--prefill, --decode, --colocated, --cpp-group, TSUKIMI_DEPLOYMENT), no policy that
    needs a prefill pool, and the model's engines on the CPU: `CPU_DEFAULT_COLOCATED` colocated instances."""
    if args.prefill or args.decode or args.colocated or args.cpp_group or "TSUKIMI_DEPLOYMENT" in os.environ:
        return False
    policy = args.policy or os.environ.get("TSUKIMI_POLICY")
    engine = args.engine or os.environ.get("TSUKIMI_ENGINE", "real")
    return engine == "real" and (policy is None or policy in COLOCATED_POLICIES) and _engines_on_cpu()


def _engines_on_cpu() -> bool:
    """TSUKIMI_DEVICE says cpu, or auto on a machine without an NVIDIA GPU (seen without importing torch)."""
    device = os.environ.get("TSUKIMI_DEVICE", "auto")
    return device == "cpu" or (device == "auto" and not any(Path("/dev").glob("nvidia[0-9]*")))


def engine_threads(num_engines: int) -> int:
    """Each engine's torch threads when `tsukimi up` runs `num_engines` on this machine: its share of the cores."""
    return max(1, (os.cpu_count() or 1) // num_engines)


def _topology(args: argparse.Namespace, settings: ClusterSettings) -> Topology:
    if args.colocated and (args.prefill or args.decode):
        raise CliError("--colocated N replaces --prefill and --decode")
    if args.colocated and args.cpp_group:
        raise CliError("--cpp-group groups prefill instances; a colocated deployment has none")
    prefill, decode = (0, args.colocated) if args.colocated else (args.prefill or 1, args.decode or 1)
    model = None
    if args.model and is_dummy(args.model):
        try:
            dummy_manifest_parts(args.model)
        except (ValueError, FileNotFoundError) as exc:
            raise CliError(str(exc)) from None
        model = args.model
    elif args.model:
        path = Path(args.model).expanduser()
        if not path.exists():
            raise CliError(f"no model at {args.model}")
        model = str(path.resolve())
    num_engines = prefill + decode
    threads = 0 if settings.engine.num_threads else engine_threads(num_engines)
    kv_share = 0.0 if "TSUKIMI_KV_MEMORY_FRACTION" in os.environ else KV_MEMORY_SHARED / num_engines
    try:
        return Topology(
            prefill=prefill, decode=decode, cache_stores=args.cache_stores, colocated=bool(args.colocated),
            host=args.host or settings.host, port=settings.port if args.port is None else args.port,
            nats_url=args.nats_url or settings.nats_url, model=model, cache_ssd_dir=settings.cache_ssd_dir,
            engine_threads=threads, kv_memory_fraction=kv_share, cpp_group=args.cpp_group or 1,
        )
    except TopologyError as exc:
        raise CliError(str(exc)) from None


def _check_exposure(host: str, settings: ClusterSettings) -> None:
    """No API open to the network by accident; an API keys file that the gateway could not read fails now."""
    try:
        check_http_exposure(host, settings.api_keys_file or "", settings.insecure_http)
        if settings.api_keys_file:
            load_api_keys(settings.api_keys_file)
    except (ConfigError, ApiKeysError) as exc:
        raise CliError(str(exc).replace("TSUKIMI_INSECURE_HTTP=on (tsukimi up --insecure)", "--insecure")) from None


def _check_port_free(host: str, port: int) -> None:
    """Fail now, with a clear message, rather than in a gateway restarting forever."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp does: TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise CliError(f"cannot listen on {host}:{port}: {reason} (another tsukimi up? try --port)") from None


def _check_modules() -> None:
    missing = [s.module for s in SERVICES if module_file(s.module) is None]
    if missing:
        raise CliError(f"cannot run {', '.join(missing)}: no such module (is tsukimi fully installed?)")


def _nats_binary() -> str:
    try:
        return str(find_nats_server())
    except NatsServerError as exc:
        raise CliError(f"{exc}, or pass --nats-url") from None


