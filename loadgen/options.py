"""The options of `tsukimi-loadgen` and their --help (how prompts are sent, what every metric means). Checks
that span several options are in cli.py.
"""

from __future__ import annotations

import argparse
import math

from loadgen.client import API_CHAT, API_COMPLETIONS
from loadgen.prompts import DEFAULT_MIN_TOKEN_ID, DEFAULT_VOCAB_SIZE

DESCRIPTION = """\
Load generator for OpenAI-compatible servers (tsukimi's gateway, vLLM, SGLang): replays a Mooncake trace or a
synthetic workload (Poisson/Gamma arrivals, or a fixed number of requests in flight), streams every answer and
reports TTFT, TPOT, ITL, E2E, TBT, goodput and effective request capacity.

How prompts are sent: with --api completions (the default) every prompt is a list of token ids sent as they are
("prompt": [ids]) to /v1/completions, so prefix sharing is exact. A trace's hash id (one per 512-token block)
becomes one fixed block of random token ids drawn from a generator seeded by (--seed, hash id): equal hash ids
give equal tokens, in every request and every run with the same seed. With --api chat the token ids become
pseudo-words, one per id, sent as one user message to /v1/chat/completions: sharing holds at the text level,
but the server's tokenizer and chat template decide the real token counts (about 1.1 tokens a word with
SmolLM2), so lengths are approximate. Every request asks for max_tokens = its output length, temperature 0,
ignore_eos (unless --no-ignore-eos) and streams with usage.
"""

EPILOG = """\
metrics (per request, times from when the request was sent):
  TTFT   time to first token: the first streamed chunk with content
  E2E    end-to-end latency: until the stream ended
  ITL    inter-token latency: the gaps between consecutive content chunks (pooled over requests)
  TPOT   time per output token: (E2E - TTFT) / (output tokens - 1); undefined for 1 token
  TBT    Mooncake's time between tokens: the mean of the request's slowest 10% of gaps (the ceil(k/10)
         largest of k gaps; 0 without gaps); its distribution is over requests with at least one gap
  SLO    a request meets the SLOs when it completed (HTTP 200, stream ended with [DONE]) and every given
         objective holds: TTFT <= --slo-ttft-ms, TBT <= --slo-tbt-ms
run:
  duration            first send to the end of the last answer (whatever its outcome)
  throughput          completed requests (or their output tokens) per second of duration
  goodput             completed requests meeting every given SLO per second of duration
  effective capacity  share of all sent requests (rejected and failed included) that completed and met the
                      TTFT and TBT SLOs (Mooncake); TTFT/TBT attainment: the same for one SLO alone
  rejected            HTTP 429, counted apart from failures (any other error, timeout or broken stream)
  cache hit rate      cached prompt tokens / prompt tokens, from usage.prompt_tokens_details.cached_tokens
Latency statistics cover completed requests; percentiles interpolate linearly between ranks (numpy's default).
Latencies include any wait for a free connection (at most 1024 open at once).

examples:
  tsukimi-loadgen --trace conversation_trace.jsonl --max-requests 200 --input-scale 0.05 --time-scale 0.5 \\
      --slo-ttft-ms 30000 --slo-tbt-ms 200 --json run.json --plot plots/
  tsukimi-loadgen --num-requests 500 --rate 8 --burstiness 0.5 --input-len 256 --output-len 64
  tsukimi-loadgen --concurrency 16 --num-requests 200 --shared-prefix-len 256 --num-prefix-groups 4
  tsukimi-loadgen experiment mooncake --quick   # the Mooncake paper's experiment on the sim backend (its --help)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tsukimi-loadgen",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_server_options(parser.add_argument_group("server"))
    _add_trace_options(parser.add_argument_group("trace workload (--trace)"))
    _add_synthetic_options(parser.add_argument_group("synthetic workload (without --trace)"))
    _add_run_options(parser.add_argument_group("run and report"))
    return parser


def _add_server_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--url", default="http://127.0.0.1:8000", help="base URL, with or without /v1 (default %(default)s)"
    )
    group.add_argument(
        "--api",
        choices=(API_COMPLETIONS, API_CHAT),
        default=API_COMPLETIONS,
        help="completions: token-id prompts to /v1/completions, exact (default); chat: pseudo-word text to "
        "/v1/chat/completions, token counts approximate",
    )
    group.add_argument("--model", help="the model field (default: the first id of GET /v1/models)")
    group.add_argument(
        "--request-timeout-s",
        type=_positive_float,
        default=600.0,
        metavar="S",
        help="a request unanswered after this long fails (default %(default)g)",
    )
    group.add_argument("--extra-body", metavar="JSON", help="a JSON object merged into every request body")
    group.add_argument("--api-key", default="", metavar="KEY",
                       help="sent as 'Authorization: Bearer KEY' (tsukimi's gateway with TSUKIMI_API_KEYS_FILE; "
                            "default: none)")
    group.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos: true")


def _add_trace_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--trace", metavar="FILE", help="a Mooncake JSONL trace to replay")
    group.add_argument(
        "--time-scale",
        type=_positive_float,
        metavar="X",
        help="multiply arrival times by X (0.5 replays twice as fast; default 1)",
    )
    group.add_argument(
        "--input-scale",
        type=_positive_float,
        metavar="X",
        help="shrink prompts keeping their sharing: a hash id becomes round(512*X) tokens and "
        "input lengths are scaled by X (default 1)",
    )
    group.add_argument("--output-scale", type=_positive_float, metavar="X", help="scale output lengths (default 1)")
    group.add_argument(
        "--start-s",
        type=_non_negative_float,
        metavar="S",
        help="start the replay at this trace time, skipping earlier lines (default 0)",
    )


def _add_synthetic_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--num-requests",
        type=_non_negative_int,
        metavar="N",
        help="requests to generate (default 100; with --duration-s, make it large enough to last)",
    )
    group.add_argument(
        "--rate", type=_rate, metavar="R", help="mean arrivals per second, or inf for all at once (default inf)"
    )
    group.add_argument(
        "--burstiness",
        type=_positive_float,
        metavar="B",
        help="Gamma shape of the gaps between arrivals: 1 is Poisson, below 1 burstier (default 1)",
    )
    group.add_argument(
        "--input-len", type=_positive_int, metavar="N", help="prompt tokens after the shared prefix (default 1024)"
    )
    group.add_argument("--output-len", type=_positive_int, metavar="N", help="output tokens (default 128)")
    group.add_argument(
        "--range-ratio", type=_ratio, metavar="R", help="lengths uniform over [len*(1-R), len*(1+R)] (default 0: fixed)"
    )
    group.add_argument(
        "--shared-prefix-len",
        type=_non_negative_int,
        metavar="N",
        help="each request starts with its group's prefix of N tokens (default 0)",
    )
    group.add_argument(
        "--num-prefix-groups",
        type=_positive_int,
        metavar="G",
        help="prefix groups; request i is in group i %% G (default 1)",
    )


def _add_run_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--seed", type=_non_negative_int, default=0, help="seeds prompts, lengths and arrivals (default 0)"
    )
    group.add_argument("--max-requests", type=_non_negative_int, metavar="N", help="send at most N requests")
    group.add_argument(
        "--concurrency",
        type=_positive_int,
        metavar="N",
        help="closed loop: keep N requests in flight, ignoring arrival times",
    )
    group.add_argument(
        "--duration-s",
        type=_positive_float,
        metavar="S",
        help="stop sending after S seconds, then wait for the requests in flight",
    )
    group.add_argument(
        "--ignore-retry-after",
        action="store_true",
        help="closed loop: send the next request at once after a refusal, instead of waiting the server's "
        "Retry-After (at most 60 s) as a real client would",
    )
    group.add_argument("--slo-ttft-ms", type=_positive_float, metavar="MS", help="TTFT objective")
    group.add_argument("--slo-tbt-ms", type=_positive_float, metavar="MS", help="TBT objective")
    group.add_argument("--json", metavar="OUT", help="write config, summary and every request's record to OUT")
    group.add_argument("--plot", metavar="DIR", help="write DIR/latency_cdf.png (TTFT, TBT, E2E, ITL CDFs)")
    group.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    group.add_argument(
        "--min-token-id",
        type=_non_negative_int,
        default=DEFAULT_MIN_TOKEN_ID,
        metavar="ID",
        help="random token ids are drawn from [ID, --vocab-size) (default %(default)s)",
    )
    group.add_argument(
        "--vocab-size", type=_positive_int, default=DEFAULT_VOCAB_SIZE, metavar="N", help="(default %(default)s)"
    )


def _number(text: str, kind: type[int] | type[float]) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a{'n integer' if kind is int else ' number'}: {text!r}") from None
    if isinstance(value, float) and math.isnan(value):
        raise argparse.ArgumentTypeError("not a number: nan")
    return value


def _positive_float(text: str) -> float:
    value = _number(text, float)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = _number(text, float)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _rate(text: str) -> float:
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive (or inf), got {text}")
    return value


def _ratio(text: str) -> float:
    value = _number(text, float)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(_number(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(_number(text, int))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value
