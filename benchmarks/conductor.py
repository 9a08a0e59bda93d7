"""Placement policies on shared-prefix traffic: for each policy a fresh `tsukimi up --prefill 2 --decode 2
--cache-stores 2 --policy P --rejection off` on loopback serves the same seeded workload on the real model, and one
table compares cache hit rate and TTFT, with the ratios of the first policy (default: conductor) to the others.

Not a test: it prints figures and asserts nothing. The workload is like multi-turn chat or shared system prompts:
K documents of about --doc-tokens tokens of English prose (--text-file), each request one document plus a short
distinct question, the document drawn with a Zipf-like skew (document 1 hottest), Poisson arrivals, greedy, streamed
with usage. TTFT is measured here, from sending to the first chunk with content; E2E to the end of the stream. Hit rate
= sum of usage.prompt_tokens_details.cached_tokens / sum of prompt_tokens over the requests answered. Requests not sent
by --max-seconds are counted as unsent; each request gives up after --request-timeout-s. The scheduler's decisions
(fetch_from_pool, on_decode, instances) come from the "placed" lines of its log. Run it as
`python benchmarks/conductor.py` from the repository root (about 3 minutes per policy with the defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from _system import (
    REPO_ROOT,
    Outcome,
    StartError,
    SystemSpec,
    chat_body,
    placement_counts,
    send,
    start_system,
    stop_system,
)

from shared.config import POLICIES

DEFAULT_TEXT = Path("/work/shared/data/text/lee_background.txt")  # gensim's Lee corpus: ~300 news articles
TOKENS_PER_WORD = 1.26  # SmolLM2's tokenizer on that text
QUESTIONS = (
    "Who is the first person named in the text above?", "Which places does the text above mention?",
    "Summarize the text above in one sentence.", "What happened first in the text above?",
    "Which numbers appear in the text above?", "What is the main topic of the text above?",
    "Name one organisation from the text above.", "What is the tone of the text above?",
)
REQUEST_PREFIX = "bench-"


@dataclass(frozen=True)
class Request:
    index: int
    doc: int
    question: str
    send_at_s: float  # after the workload's start


@dataclass
class PolicyResult:
    policy: str
    error: str = ""  # the system did not come up or the run broke off
    outcomes: list[Outcome] = field(default_factory=list)
    placements: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0


# ---- workload -------------------------------------------------------------------------------------------------


def read_words(path: Path) -> list[str]:
    if not path.is_file():
        say("bench", f"{path} not found; using the repository README as text")
        path = REPO_ROOT / "README.md"
    return path.read_text(errors="replace").split()


def make_documents(words: list[str], num_docs: int, doc_tokens: int) -> list[str]:
    """Consecutive spans of the text (wrapping around when it is too short), one per document."""
    per_doc = max(1, round(doc_tokens / TOKENS_PER_WORD))
    spans = [[words[(d * per_doc + i) % len(words)] for i in range(per_doc)] for d in range(num_docs)]
    return [f"Document {d + 1}:\n" + " ".join(span) for d, span in enumerate(spans)]


def make_requests(args: argparse.Namespace) -> list[Request]:
    """The same list for every policy: Zipf-weighted documents, Poisson arrival times."""
    rng = random.Random(args.seed)
    weights = [1.0 / (rank + 1) ** args.zipf for rank in range(args.num_docs)]
    docs = rng.choices(range(args.num_docs), weights=weights, k=args.num_requests)
    requests, clock = [], 0.0
    for index, doc in enumerate(docs):
        question = f"Question {index + 1}: {QUESTIONS[index % len(QUESTIONS)]}"
        requests.append(Request(index, doc, question, clock))
        clock += rng.expovariate(args.rate)
    return requests


# ---- driving one system ---------------------------------------------------------------------------------------


class Progress:
    """`[policy] 23/60 sent, 20 done` on stderr: rewritten in place on a terminal, else a line every 10 s."""

    def __init__(self, policy: str, total: int) -> None:
        self.policy, self.total, self.sent, self.done = policy, total, 0, 0
        self.is_tty = sys.stderr.isatty()
        self._next_line = time.monotonic() + 10.0

    def update(self, sent: int = 0, done: int = 0, final: bool = False) -> None:
        self.sent, self.done = self.sent + sent, self.done + done
        line = f"[{self.policy}] {self.sent}/{self.total} sent, {self.done} done"
        if self.is_tty:
            print(f"\r{line}", end="\n" if final else "", file=sys.stderr, flush=True)
        elif final or time.monotonic() >= self._next_line:
            self._next_line = time.monotonic() + 10.0
            print(line, file=sys.stderr, flush=True)


async def run_workload(base_url: str, docs: list[str], requests: list[Request], args: argparse.Namespace,
                       progress: Progress) -> list[Outcome]:
    """Warm up, then send each request at its time (none after --max-seconds); wait for all answers."""
    url = f"{base_url}/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=0)  # arrivals never queue in the client
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        async with session.get(f"{base_url}/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        await warm_up(session, url, model, args)
        outcomes = [Outcome(r.index, r.doc) for r in requests]
        tasks = []
        start = time.monotonic()
        for request, outcome in zip(requests, outcomes, strict=True):
            if max(request.send_at_s, time.monotonic() - start) > args.max_seconds:
                break
            await asyncio.sleep(max(0.0, start + request.send_at_s - time.monotonic()))
            body = chat_body(model, f"{docs[request.doc]}\n\n{request.question}", args.max_tokens)
            task = asyncio.create_task(send(session, url, body, f"{REQUEST_PREFIX}{request.index:04d}", outcome,
                                            args.request_timeout_s))
            task.add_done_callback(lambda _: progress.update(done=1))
            tasks.append(task)
            progress.update(sent=1)
        await asyncio.gather(*tasks)
    progress.update(final=True)
    return outcomes


async def warm_up(session: aiohttp.ClientSession, url: str, model: str, args: argparse.Namespace) -> None:
    """Short unrelated prompts at once, so that first-call costs (and the cost models' first fits) are not measured."""
    bodies = [chat_body(model, f"Warm-up {i}: say hello.", 4) for i in range(args.warmup)]
    outcomes = await asyncio.gather(*(send(session, url, body, f"warmup-{i}", Outcome(-1, -1), args.request_timeout_s)
                                      for i, body in enumerate(bodies)))
    failed = [o.detail for o in outcomes if o.status != "ok"]
    if failed:
        say("bench", f"{len(failed)} of {len(bodies)} warm-up requests failed: {failed[0]}")


def run_policy(policy: str, docs: list[str], requests: list[Request], args: argparse.Namespace) -> PolicyResult:
    """A fresh system for `policy`, the workload, the system stopped; a system that did not come up is reported."""
    log_dir = args.log_dir / policy
    spec = SystemSpec(policy, kv_cache_mb=args.kv_cache_mb, startup_timeout_s=args.startup_timeout_s)
    say(policy, f"starting 2 prefill, 2 decode, 2 cache-stores; logs in {log_dir}")
    started = time.monotonic()
    try:
        system = start_system(spec, log_dir, lambda line: say(policy, line))
    except StartError as exc:
        say(policy, f"did not come up: {exc}")
        return PolicyResult(policy, error=f"did not come up: {exc}")
    say(policy, f"up after {time.monotonic() - started:.0f} s; {args.warmup} warm-up requests, then the workload")
    result = PolicyResult(policy)
    started = time.monotonic()
    try:
        result.outcomes = asyncio.run(run_workload(system.base_url, docs, requests, args,
                                                   Progress(policy, len(requests))))
    except (aiohttp.ClientError, OSError, KeyError, ValueError) as exc:
        result.error = f"the run broke off: {type(exc).__name__}: {exc}"
        say(policy, result.error)
    finally:
        result.wall_s = time.monotonic() - started
        code, took = stop_system(system)
        say(policy, f"stopped (exit code {code}, {took:.1f} s)")
    result.placements = placement_counts(log_dir, REQUEST_PREFIX)
    return result


# ---- report ---------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    pos = (len(ordered) - 1) * q
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(result: PolicyResult) -> dict[str, Any]:
    ok = [o for o in result.outcomes if o.status == "ok"]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    prompt_tokens = sum(o.prompt_tokens for o in ok)
    counts = {status: sum(o.status == status for o in result.outcomes) for status in ("ok", "rejected", "error")}
    return {
        **counts, "unsent": sum(o.status == "unsent" for o in result.outcomes),
        "hit_rate": sum(o.cached_tokens for o in ok) / prompt_tokens if prompt_tokens else None,
        "mean_prompt_tokens": prompt_tokens / len(ok) if ok else None,
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p90_s": percentile(ttfts, 0.9),
        "e2e_p50_s": percentile([o.e2e_s for o in ok if o.e2e_s is not None], 0.5),
    }


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def ratio(ours: float | None, theirs: float | None) -> str:
    return f"x{ours / theirs:.2f}" if ours is not None and theirs else "x-"


def report(results: list[PolicyResult], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Print the table, the ratios and the scheduler's decisions; return the summaries by policy."""
    print(f"Shared-prefix workload: {args.num_requests} requests over {args.num_docs} documents of ~{args.doc_tokens} "
          f"tokens (Zipf s={args.zipf}), Poisson {args.rate} req/s, max_tokens {args.max_tokens}, greedy, seed "
          f"{args.seed}; each policy on a fresh system of 2 prefill, 2 decode, 2 cache-stores, KV pool "
          f"{args.kv_cache_mb} MiB per engine, rejection off.")
    print(f"{machine_label()} Seconds from this client; TTFT and E2E over the requests answered.")
    print(f"{'policy':<18}{'ok':>4}{'429':>5}{'err':>5}{'unsent':>7}{'prompt tok':>11}{'hit rate':>9}"
          f"{'TTFT mean':>10}{'p50':>7}{'p90':>7}{'E2E p50':>9}")
    summaries = {r.policy: summarize(r) for r in results if not r.error or r.outcomes}
    for result in results:
        s = summaries.get(result.policy)
        if s is None:
            print(f"{result.policy:<18}{result.error}")
            continue
        print(f"{result.policy:<18}{s['ok']:>4}{s['rejected']:>5}{s['error']:>5}{s['unsent']:>7}"
              f"{fmt(s['mean_prompt_tokens'], 0):>11}{fmt(s['hit_rate']):>9}{fmt(s['ttft_mean_s']):>10}"
              f"{fmt(s['ttft_p50_s']):>7}{fmt(s['ttft_p90_s']):>7}{fmt(s['e2e_p50_s']):>9}")
    print_ratios(summaries)
    for result in results:
        print_placements(result)
    return summaries


def print_ratios(summaries: dict[str, dict[str, Any]]) -> None:
    if not summaries:
        return
    ours_name = "conductor" if "conductor" in summaries else next(iter(summaries))
    ours = summaries[ours_name]
    for name, theirs in summaries.items():
        if name != ours_name:
            ttft, hits = (ours["ttft_p50_s"], theirs["ttft_p50_s"]), (ours["hit_rate"], theirs["hit_rate"])
            print(f"{ours_name} vs {name}: TTFT p50 {ratio(*ttft)} of {name} ({fmt(ttft[0])} s vs {fmt(ttft[1])} s), "
                  f"hit rate {ratio(*hits)} of {name} ({fmt(hits[0])} vs {fmt(hits[1])})")


def print_placements(result: PolicyResult) -> None:
    p = result.placements
    if not p:
        return
    where = {role: ", ".join(f"{k.split(':', 1)[1]} {v}" for k, v in sorted(p.items()) if k.startswith(f"{role}:"))
             for role in ("prefill", "decode")}
    print(f"{result.policy} scheduler log: {p.get('placed', 0)} placed, {p.get('rejected', 0)} rejected; "
          f"fetch_from_pool true {p.get('fetch_from_pool_true', 0)} / false {p.get('fetch_from_pool_false', 0)}; "
          f"on_decode {p.get('on_decode_true', 0)}; reused blocks {p.get('reused_blocks', 0)}; "
          f"prefill on {where['prefill']}; decode on {where['decode']}")


def machine_label() -> str:
    gpu = "a GPU present" if Path("/dev/nvidia0").exists() else "no GPU"
    model = os.environ.get("TSUKIMI_MODEL") or "the 135M-parameter SmolLM2-135M-Instruct model"
    return (f"Measured on a {os.cpu_count()}-core CPU machine ({gpu}; cores shared with other work) with {model}: "
            "compare the ratios within one run, not the seconds.")


def write_json(path: Path, args: argparse.Namespace, results: list[PolicyResult],
               summaries: dict[str, dict[str, Any]]) -> None:
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"}
    policies = [{"policy": r.policy, "error": r.error, "wall_s": r.wall_s, "summary": summaries.get(r.policy),
                 "placements": r.placements, "requests": [asdict(o) for o in r.outcomes]} for r in results]
    path.write_text(json.dumps({"machine": machine_label(), "settings": settings, "policies": policies}, indent=1))


# ---- main -----------------------------------------------------------------------------------------------------


def say(tag: str, line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] [{tag}] {line}", file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--policies", nargs="+", default=["conductor", "least_loaded", "random"],
        choices=POLICIES, metavar="POLICY",
        help=f"policies to run, each on a fresh system, of: {' '.join(POLICIES)} (default: conductor least_loaded "
             "random); ratios are of conductor (else the first) to each other")
    add("--num-requests", type=int, default=60, help="requests per policy (default 60)")
    add("--rate", type=float, default=0.5, help="mean arrival rate, requests/s, Poisson (default 0.5)")
    add("--num-docs", type=int, default=6, help="distinct documents (shared prefixes) (default 6)")
    add("--doc-tokens", type=int, default=600, help="about this many tokens per document (default 600)")
    add("--zipf", type=float, default=1.0, help="skew: document k is drawn with weight 1/k^s (default 1.0)")
    add("--max-tokens", type=int, default=8, help="output tokens per request (default 8)")
    add("--seed", type=int, default=0, help="seed of the workload, the same for every policy (default 0)")
    add("--text-file", type=Path, default=DEFAULT_TEXT,
        help=f"English text the documents are cut from (default {DEFAULT_TEXT}, news articles of gensim's Lee "
             "corpus; the repository README if missing)")
    add("--warmup", type=int, default=4, help="short unmeasured requests before the workload (default 4)")
    add("--max-seconds", type=float, default=600.0,
        help="per policy, requests not sent by then are left unsent (default 600)")
    add("--request-timeout-s", type=float, default=120.0, help="one request gives up after this long (default 120)")
    add("--startup-timeout-s", type=float, default=300.0, help="wait this long for /health (default 300)")
    add("--kv-cache-mb", type=int, default=64,
        help="paged KV pool of each prefill and decode engine, MiB: sets TSUKIMI_KV_CACHE_MB (default 64)")
    add("--log-dir", type=Path, help="each system's logs go to DIR/<policy> (default: a new temporary folder)")
    add("--json", type=Path, metavar="PATH", help="also write the settings, summaries and every request here")
    args = parser.parse_args()
    positive = ("num_requests", "rate", "num_docs", "doc_tokens", "max_tokens", "max_seconds", "request_timeout_s",
                "startup_timeout_s", "kv_cache_mb")
    bad = [f"--{name.replace('_', '-')}" for name in positive if getattr(args, name) <= 0]
    if bad or args.warmup < 0 or args.zipf < 0:
        parser.error(f"{', '.join(bad) or '--warmup and --zipf'} must be positive")
    args.log_dir = (args.log_dir or Path(tempfile.mkdtemp(prefix="tsukimi-bench-"))).resolve()
    return args


def main() -> None:
    args = parse_args()
    docs = make_documents(read_words(args.text_file), args.num_docs, args.doc_tokens)
    requests = make_requests(args)
    say("bench", f"{len(requests)} requests over {requests[-1].send_at_s:.0f} s for each of {', '.join(args.policies)};"
        f" logs in {args.log_dir}")
    results = []
    try:
        for policy in dict.fromkeys(args.policies):
            results.append(run_policy(policy, docs, requests, args))
    except KeyboardInterrupt:
        say("bench", "interrupted; reporting the policies finished so far")
    summaries = report(results, args)
    if args.json:
        write_json(args.json, args, results, summaries)
        say("bench", f"wrote {args.json}")


if __name__ == "__main__":
    main()
