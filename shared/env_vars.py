"""Every `TSUKIMI_*` environment variable: its name, its default and what it means, each declared once.

`shared.config` reads the environment against this table; the engine's and FastGen's dataclasses and the CLI's flags
take their defaults from it (`default_int`, `default_float`), so a default cannot differ between `tsukimi up`, a
service and `tsukimi generate`. Imports nothing of tsukimi: every layer may read it.
"""

from __future__ import annotations

from dataclasses import dataclass

# TSUKIMI_MAX_BATCHED_TOKENS of a prefill instance where it is not set. On a 2-core Xeon with AMX the model's bf16
# matmuls ran about 1.5x faster a token at 2,048 rows than at 512, and so did the engine's prefill
# (docs/experiments/performance.md, "With AMX").
PREFILL_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str


ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in [
        EnvVar("TSUKIMI_NATS_URL", "nats://127.0.0.1:4222", "NATS server URL(s), comma-separated"),
        EnvVar("TSUKIMI_NATS_USER", "", "NATS user (default: the service's role, when a password is set)"),
        EnvVar("TSUKIMI_NATS_PASSWORD", "", "NATS password of this service's role (empty: connect without one)"),
        EnvVar("TSUKIMI_NATS_PASSWORD_FILE", "", "a file holding the NATS password (instead of TSUKIMI_NATS_PASSWORD)"),
        EnvVar("TSUKIMI_NATS_TLS_CA_FILE", "", "TLS to NATS: the CA that signed the server's certificate"),
        EnvVar("TSUKIMI_NATS_TLS_CERT_FILE", "", "TLS to NATS: this client's certificate (for servers that verify it)"),
        EnvVar("TSUKIMI_NATS_TLS_KEY_FILE", "", "TLS to NATS: the key of TSUKIMI_NATS_TLS_CERT_FILE"),
        EnvVar("TSUKIMI_SUBJECT_PREFIX", "tsukimi", "first token of every NATS subject"),
        EnvVar("TSUKIMI_INSTANCE_ID", "", "this instance's id (default: <role>-<host>-<pid>-<random>)"),
        EnvVar("TSUKIMI_LOG_LEVEL", "info", "debug, info, warning or error"),
        EnvVar("TSUKIMI_LOG_FORMAT", "json", "json (one object per line) or console"),
        EnvVar("TSUKIMI_MODEL", "", "GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)"),
        EnvVar("TSUKIMI_MODEL_NAME", "SmolLM2-135M-Instruct", "model id the API serves and accepts"),
        EnvVar("TSUKIMI_ENGINE", "real",
               "real (run the model) or sim (steps sleep for a roofline model of TSUKIMI_SIM_PROFILE)"),
        EnvVar("TSUKIMI_SIM_PROFILE", "llama3-70b-8xa800", "model and GPUs the sim engine stands for"),
        EnvVar("TSUKIMI_SIM_KV_CODEC", "none",
               "the sim engine's KV in the pool and on every wire at this codec's bytes (none: the dtype's); sizes "
               "alone, so no calibration: kvquant-b at its width and default outlier share. GPU memory keeps the "
               "dtype's"),
        EnvVar("TSUKIMI_SIM_KV_TOKENS", "0",
               "tokens of KV each sim instance holds (0: what the profile's GPUs hold beside the weights); more "
               "stands a node's local DRAM cache in for its prefix cache (Mooncake's local-cache study)"),
        EnvVar("TSUKIMI_DEPLOYMENT", "disaggregated",
               "disaggregated (prefill and decode pools) or colocated (decode instances prefill too, no prefill pool)"),
        EnvVar("TSUKIMI_DEVICE", "auto", "cpu, cuda, cuda:N or auto"),
        EnvVar("TSUKIMI_DTYPE", "fp32",
               "weights and KV cache: fp32, bf16 or fp16 (tsukimi up, unless set: bf16 where the CPU computes bf16)"),
        EnvVar("TSUKIMI_KERNELS", "auto", "auto, torch, triton or cpu"),
        EnvVar("TSUKIMI_KERNEL_CACHE", "", "where the C++ CPU kernels are built (default: ~/.cache/tsukimi/kernels)"),
        EnvVar("TSUKIMI_NUM_THREADS", "0", "torch CPU threads per process (0: torch's default)"),
        EnvVar("TSUKIMI_KV_CACHE_MB", "auto",
               "KV pool of a prefill or decode instance, MiB (SmolLM2 bf16: 45 tokens a MiB), or auto: "
               "TSUKIMI_KV_MEMORY_FRACTION of the memory available once the weights are loaded, no more than "
               "TSUKIMI_MAX_NUM_SEQS sequences of the model's whole context; on the CPU a pool takes memory as it "
               "fills"),
        EnvVar("TSUKIMI_KV_MEMORY_FRACTION", "0.25",
               "with TSUKIMI_KV_CACHE_MB=auto, the share of the host's (or container's) available memory, or of a "
               "GPU's free memory, this instance's KV pool takes; tsukimi up shares 0.5 among its engines"),
        EnvVar("TSUKIMI_BLOCK_SIZE", "64", "tokens per KV block"),
        EnvVar("TSUKIMI_KV_CODEC", "none", "KV block storage: none (raw), fp16, int8, kivi-4/3/2, kvquant-4/3/2"),
        EnvVar("TSUKIMI_KV_CALIB", "", "calibration file of a kvquant codec (default: the one shipped for SmolLM2)"),
        EnvVar("TSUKIMI_KV_POLICY", "full",
               "full (keep every token's KV) or fastgen (each KV head keeps what its profiled policy keeps)"),
        EnvVar("TSUKIMI_FASTGEN_T", "0.95", "FastGen: attention mass a head's policy must recover, in (0, 1]"),
        EnvVar("TSUKIMI_FASTGEN_R_LOCAL", "0.3", "FastGen: the local window, a share of the length"),
        EnvVar("TSUKIMI_FASTGEN_R_FREQUENT", "0.3", "FastGen: the heavy-hitter budget, a share of the length"),
        EnvVar("TSUKIMI_FASTGEN_PROFILE_ROWS", "512", "FastGen: the prompt's last query rows it profiles on"),
        EnvVar("TSUKIMI_FASTGEN_WIDER_LOCAL", "0.5,0.7", "FastGen: wider windows tried before the full cache (none)"),
        EnvVar("TSUKIMI_FASTGEN_FREQUENT_ALONE", "off", "FastGen: heavy hitters without the window are a policy"),
        EnvVar("TSUKIMI_MAX_NUM_SEQS", "64", "most sequences in a decode batch"),
        EnvVar("TSUKIMI_MAX_BATCHED_TOKENS", "512",
               "tokens per forward step, decode tokens and prefill chunks (a chunk this small keeps the running "
               f"decodes' TBT; a prefill instance, whose steps hold no decodes, runs {PREFILL_BATCHED_TOKENS} unless "
               "this is set: AMX CPUs and GPUs compute a token faster in larger steps)"),
        EnvVar("TSUKIMI_PREFIX_CACHING", "on",
               "an engine reuses the KV of full blocks it computed or loaded before (its local prefix cache); off "
               "stands for a baseline without it"),
        EnvVar("TSUKIMI_HEARTBEAT_S", "0.5", "seconds between heartbeats of an instance"),
        EnvVar("TSUKIMI_WARMUP", "on",
               "prefill and decode time a few steps of their own before serving, for the scheduler's cost models"),
        EnvVar("TSUKIMI_INSTANCE_TIMEOUT_S", "2.5", "an instance silent this long is forgotten by the scheduler"),
        EnvVar("TSUKIMI_KV_DEADLINE_S", "10", "decode fails a request whose KV stream stalls this long once its KV "
               "began to flow (before, the request waits in prefill's queue, up to TSUKIMI_REQUEST_TIMEOUT_S)"),
        EnvVar("TSUKIMI_KV_CHUNK_KB", "256", "largest KV payload per NATS message, KiB"),
        EnvVar("TSUKIMI_KV_BUFFER_MB", "1024",
               "decode: most MiB of prompt KV in flight (1/16 of it for KV the scheduler did not announce)"),
        EnvVar("TSUKIMI_CPP_GROUP", "",
               "prefill: the instance ids of this instance's pipeline group, first stage first, comma-separated (empty:"
               " none; `tsukimi up --cpp-group N` sets it): long prompts run through the group's stages"),
        EnvVar("TSUKIMI_CPP_MIN_TOKENS", "2048",
               "prefill in a pipeline group: prompts with at least this many tokens to compute run on the group"),
        EnvVar("TSUKIMI_CPP_KV_MB", "256", "prefill in a pipeline group: MiB of its stage's own KV pool (its layers)"),
        EnvVar("TSUKIMI_KV_COMPRESS", "off", "LZ4 on prefill->decode KV chunks: on pays on links under ~40 MB/s"),
        EnvVar("TSUKIMI_POLICY", "conductor",
               "placement: random, round_robin, least_loaded, local_cache_aware or conductor"),
        EnvVar("TSUKIMI_POLICY_SEED", "",
               "seeds the random placement policies' choices, for runs that repeat (empty: a new seed each start)"),
        EnvVar("TSUKIMI_SLO_TTFT_MS", "10000", "time-to-first-token SLO; a request predicted to miss it gets 429"),
        EnvVar("TSUKIMI_SLO_TBT_MS", "500", "time-between-tokens SLO; decode predicted slower than this gets 429"),
        EnvVar("TSUKIMI_REJECTION", "predicted",
               "early rejection: off, current (decode load now) or predicted (when the request reaches decode)"),
        EnvVar("TSUKIMI_CACHE_BALANCE_RATIO", "1.5",
               "fetch the cache-store's prefix when it is this many times longer than the local one"),
        EnvVar("TSUKIMI_LOCAL_PREFILL_TOKENS", "128",
               "prompts with at most this many tokens to compute may be prefilled on the decode instance (0: never;"
               " `tsukimi up` on one machine: 512)"),
        EnvVar("TSUKIMI_HOST", "127.0.0.1", "gateway listen address"),
        EnvVar("TSUKIMI_PORT", "8000", "gateway listen port"),
        EnvVar("TSUKIMI_MAX_BODY_KB", "1024", "largest HTTP request body, KiB (larger: 413)"),
        EnvVar("TSUKIMI_REQUEST_TIMEOUT_S", "300", "gateway gives up on a request silent this long"),
        EnvVar("TSUKIMI_PROGRESS_TIMEOUT_S", "15",
               "gateway fails a request (503) with no stream event this long while no live instance holds it"),
        EnvVar("TSUKIMI_MIGRATION_LIMIT", "3",
               "times the gateway places a request again after the instance holding it was lost (0: never): before "
               "its first token it runs again, mid-answer it goes on from the next token elsewhere"),
        EnvVar("TSUKIMI_SCHEDULER_WAIT_S", "3",
               "gateway keeps submitting a request this long while no scheduler answers (a restarting one), then 503"),
        EnvVar("TSUKIMI_HTTP_READ_TIMEOUT_S", "30",
               "gateway closes a connection whose request headers or body take longer, or that idles this long"),
        EnvVar("TSUKIMI_API_KEYS_FILE", "", "JSON file of hashed API keys (tsukimi keys add); empty: no API keys"),
        EnvVar("TSUKIMI_INSECURE_HTTP", "off",
               "on: the gateway may listen beyond loopback without API keys (anyone who reaches it is served)"),
        EnvVar("TSUKIMI_CACHE_BLOCK_KEY", "",
               "prefill: the key that signs and checks KV blocks in the cache-store (`tsukimi secrets` makes one)"),
        EnvVar("TSUKIMI_CACHE_BLOCK_KEY_FILE", "", "a file holding TSUKIMI_CACHE_BLOCK_KEY"),
        EnvVar("TSUKIMI_CACHE_SHARD", "0", "this cache-store's shard index"),
        EnvVar("TSUKIMI_CACHE_SHARDS", "1", "number of cache-store shards (blocks go to hash % shards)"),
        EnvVar("TSUKIMI_CACHE_DRAM_MB", "1024", "cache-store DRAM tier, MiB"),
        EnvVar("TSUKIMI_CACHE_SSD_DIR", "", "cache-store SSD tier folder (empty: no SSD tier)"),
        EnvVar("TSUKIMI_CACHE_SSD_MB", "4096", "cache-store SSD tier, MiB of block files"),
        EnvVar("TSUKIMI_CACHE_SSD_ADMIT_SEEN", "2",
               "a block leaving DRAM goes to SSD only if put or asked for this often (1: always)"),
    ]
}


def default(name: str) -> str:
    """The default of variable `name` as written in the table. Raises KeyError for an unknown name."""
    return ENV_VARS[name].default


def default_int(name: str) -> int:
    return int(default(name))


def default_float(name: str) -> float:
    return float(default(name))
