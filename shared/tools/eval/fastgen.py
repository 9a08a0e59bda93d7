"""What `tsukimi eval fastgen` measures: teacher-forced continuations with the full KV cache and with FastGen in the
same run (perplexity, KL, top-1 agreement, the share of KV kept, the policies chosen), and StreamingLLM and H2O at
FastGen's memory, on windows of a text's evaluation span; with a kvquant codec, the full cache and FastGen once more
with their K/V as the engine serves them over it (`fastgen_codecs`).

Owns the windows' schedule and the figures; the attention is `fastgen_attention`'s, the policies
`shared.fastgen.profile`'s and `shared.fastgen.kept`'s.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.fastgen.kept import FastGenRule, HeavyHitterRule, KeepAll, KeptRule, SinkWindowRule
from shared.fastgen.policies import FastGenSettings
from shared.fastgen.profile import LayerProfile, policy_counts, profile_layer
from shared.fastgen.token_classes import TokenClasses
from shared.model.checkpoint import Checkpoint
from shared.model.llama import Llama, build_model
from shared.tools.eval.agreement import Agreement
from shared.tools.eval.fastgen_attention import DecodeAttention, PrefillAttention
from shared.tools.eval.fastgen_codecs import KvServing, ServedKv
from shared.tools.eval.text_spans import evaluation_span, windows

BASELINES: dict[str, Callable[[float], KeptRule]] = {"streaming_llm": SinkWindowRule, "h2o": HeavyHitterRule}

Progress = Callable[[int, int], None]  # (window about to run, 1-based; number of windows)


@dataclass(frozen=True)
class WindowSpec:
    """Each window: `prompt_len` prompt tokens, then `gen_len` tokens fed one at a time as if generated, each
    predicting the next (so a window holds prompt_len + gen_len + 1 tokens); `num_windows` of them at most."""

    prompt_len: int = 512
    gen_len: int = 256
    num_windows: int = 4

    @property
    def window_len(self) -> int:
        return self.prompt_len + self.gen_len + 1


@dataclass
class _Totals(Agreement):
    """One method's sums against the full cache's predictions, and its kept KV."""

    kept_fraction_sum: float = 0.0  # of each decode step's kept fraction

    def figures(self, ppl_full: float) -> dict[str, float]:
        return {
            "ppl": self.ppl, "rel_ppl_increase": self.ppl / ppl_full - 1,
            "kv_kept_fraction": self.kept_fraction_sum / self.num_predictions,
            "top1_agreement": self.top1_agreement, "kl": self.mean_kl,
        }


@dataclass
class _Run:
    """Everything summed over the windows."""

    full: _Totals = field(default_factory=_Totals)
    fastgen: _Totals = field(default_factory=_Totals)
    baselines: dict[str, _Totals] = field(default_factory=lambda: {name: _Totals() for name in BASELINES})
    coded: dict[str, _Totals] = field(default_factory=lambda: {"full": _Totals(), "fastgen": _Totals()})
    policies: Counter[str] = field(default_factory=Counter)
    layer_kept: torch.Tensor | None = None  # FastGen's kept fraction per layer, summed over windows
    prefill_s: float = 0.0
    profile_s: float = 0.0


def evaluate_fastgen(
    checkpoint: Checkpoint, tokens: Sequence[int], settings: FastGenSettings, spec: WindowSpec,
    progress: Progress | None = None, classes: TokenClasses | None = None, *, codec: KvServing | None = None,
) -> dict[str, Any]:
    """Run the model (fp32, CPU) over windows of the text's evaluation span: per window one prompt pass (full
    attention, FastGen's profile), then the continuation decoded token by token with the full cache and FastGen side
    by side, then with StreamingLLM and H2O, each holding per layer FastGen's kept fraction of that window and layer
    (averaged over its steps), the same for every head. With `codec`, the first decode also runs the full cache as
    the engine's kvquant blocks and FastGen as its lanes of kvquant records beside a ring of the newest W tokens
    (`fastgen_codecs.ServedKv`).

    Args:
        checkpoint: the model.
        tokens: the whole text's tokens; only its evaluation span (`text_spans.evaluation_span`) is read, cut into
            consecutive non-overlapping windows of `spec.window_len` tokens.
        settings: FastGen's T, r_l, r_f and profiled rows.
        spec: the windows.
        progress: called with (window, number of windows) before each window.
        classes: the token classes (default: from the checkpoint's tokenizer).
        codec: the coded variants' codecs and block size W (default: none, no coded variants).
    Returns:
        ppl, ppl_full, rel_ppl_increase (ppl / ppl_full - 1), kl (KL(full || fastgen), mean nats per prediction),
        top1_agreement, kv_kept_fraction (kept (token, KV head, layer) entries over all, each decode step's share
        averaged over the steps of every window; a step's entries are those it attends to, its own included),
        policy_histogram ((window, layer, KV head) triples per policy), baselines (name -> ppl, rel_ppl_increase,
        kv_kept_fraction, top1_agreement, kl), layer_kv_kept_fraction, prefill_s, profile_s, and the settings;
        with a codec, codec: name, entry_bytes (a lane record's), fp16_entry_bytes, block_size (W), full and
        fastgen (the same five figures as a baseline's, against the uncoded full cache) and kv_bytes_fraction
        (coded FastGen's bytes over the full cache's in fp16: its kept fraction x entry_bytes / fp16_entry_bytes,
        plus the ring, W of each step's L tokens in every lane, counted as fp16, averaged over the steps).
    Raises:
        ValueError: lengths out of range (a window past the model's positions, profiled rows past the prompt).
        TextSpanError: the evaluation span holds less than one window.
    """
    config = checkpoint.config
    _check(spec, settings, config.max_position)
    if classes is None:
        classes = TokenClasses.from_tokenizer(checkpoint.tokenizer, config.vocab_size)
    spans = windows(evaluation_span(list(tokens)), spec.window_len, spec.num_windows)
    model = build_model(config, checkpoint.state_dict, torch.float32, torch.device("cpu"))
    run = _Run()
    with torch.inference_mode():
        for index, window in enumerate(spans):
            if progress is not None:
                progress(index + 1, len(spans))
            _run_window(model, torch.tensor(window), classes, settings, spec, run, codec)
    assert run.layer_kept is not None
    figures = run.fastgen.figures(run.full.ppl)
    codec_figures = {} if codec is None else {"codec": _codec_figures(codec, run, spec)}
    return {
        **figures, "ppl_full": run.full.ppl,
        "policy_histogram": dict(run.policies),
        "baselines": {name: totals.figures(run.full.ppl) for name, totals in run.baselines.items()},
        "layer_kv_kept_fraction": (run.layer_kept / len(spans)).tolist(),
        "threshold": settings.threshold, "r_local": settings.r_local, "r_frequent": settings.r_frequent,
        "wider_local": list(settings.wider_local), "frequent_alone": settings.frequent_alone,
        "profile_rows": min(settings.profile_rows or spec.prompt_len, spec.prompt_len),
        "prompt_len": spec.prompt_len, "gen_len": spec.gen_len, "num_windows": len(spans),
        "num_predictions": run.full.num_predictions,
        "prefill_s": round(run.prefill_s, 2), "profile_s": round(run.profile_s, 2), **codec_figures,
    }


def _codec_figures(codec: KvServing, run: _Run, spec: WindowSpec) -> dict[str, Any]:
    entry = codec.figures()
    coded = {name: totals.figures(run.full.ppl) for name, totals in run.coded.items()}
    records = coded["fastgen"]["kv_kept_fraction"] * codec.lanes.entry_bytes / int(entry["fp16_entry_bytes"])
    lengths = range(spec.prompt_len + 1, spec.prompt_len + spec.gen_len + 1)  # each step's L, the same every window
    ring = sum(min(codec.block_size, length) / length for length in lengths) / spec.gen_len
    return {**entry, **coded, "kv_bytes_fraction": records + ring}


def _check(spec: WindowSpec, settings: FastGenSettings, max_position: int) -> None:
    if spec.prompt_len < 1 or spec.gen_len < 1 or spec.num_windows < 1:
        raise ValueError(f"prompt_len, gen_len and num_windows must be at least 1, got {spec}")
    if spec.window_len > max_position:
        raise ValueError(
            f"a window of {spec.prompt_len} + {spec.gen_len} + 1 tokens exceeds the model's {max_position} positions"
        )
    if settings.profile_rows is not None and settings.profile_rows > spec.prompt_len:
        raise ValueError(f"cannot profile {settings.profile_rows} rows of a {spec.prompt_len}-token prompt")


def _run_window(
    model: Llama, ids: torch.Tensor, classes: TokenClasses, settings: FastGenSettings, spec: WindowSpec, run: _Run,
    codec: KvServing | None,
) -> None:
    """One window: the prompt pass and profile, full and FastGen (and both served over `codec`, variants 2 and 3),
    then the baselines at FastGen's memory."""
    token_classes = classes.of(ids)
    prompt_classes = (token_classes[0][: spec.prompt_len], token_classes[1][: spec.prompt_len])
    num_kv_heads = model.config.num_kv_heads
    profiles: list[LayerProfile] = []
    prefill = PrefillAttention(
        settings.profile_rows,
        lambda layer, probs: profiles.append(profile_layer(probs, prompt_classes, num_kv_heads, settings)),
    )
    start = time.perf_counter()
    model(ids[: spec.prompt_len], torch.arange(spec.prompt_len), prefill)
    run.prefill_s += time.perf_counter() - start
    run.profile_s += prefill.profile_s
    scores = [profile.scores for profile in profiles]
    for profile in profiles:
        run.policies.update({k: v for k, v in policy_counts(profile.policies, settings).items() if v})

    fastgen_rules = [FastGenRule(profile.policies, token_classes, settings) for profile in profiles]
    full_rules = [KeepAll() for _ in profiles]
    rules: list[Sequence[KeptRule]] = [full_rules, fastgen_rules] * (1 if codec is None else 2)
    coded = [] if codec is None else [ServedKv(codec, model.rotary, 2, lanes=False),
                                      ServedKv(codec, model.rotary, 3, lanes=True)]
    log_probs, kept = _decode(model, ids, spec, DecodeAttention(prefill, scores, rules, len(ids), coded))
    targets = ids[spec.prompt_len + 1 :]
    methods = [run.full, run.fastgen] + ([] if codec is None else [run.coded["full"], run.coded["fastgen"]])
    for variant, method in enumerate(methods):
        method.add(log_probs[variant], log_probs[0], targets)
        method.kept_fraction_sum += float(kept[variant].mean(dim=1).sum())
    layer_kept = kept[1].mean(dim=0)  # [layers], FastGen's, averaged over the steps
    run.layer_kept = layer_kept if run.layer_kept is None else run.layer_kept + layer_kept

    baseline_rules = [[make(float(fraction)) for fraction in layer_kept] for make in BASELINES.values()]
    baseline_log_probs, baseline_kept = _decode(
        model, ids, spec, DecodeAttention(prefill, scores, baseline_rules, len(ids))
    )
    for variant, totals in enumerate(run.baselines.values()):
        totals.add(baseline_log_probs[variant], log_probs[0], targets)
        totals.kept_fraction_sum += float(baseline_kept[variant].mean(dim=1).sum())


def _decode(
    model: Llama, ids: torch.Tensor, spec: WindowSpec, ctx: DecodeAttention
) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed the window's continuation one token per step to every variant of `ctx`.

    Returns:
        log-probabilities [variants, gen_len, vocab] of the next token after each step, and the kept fraction
        [variants, gen_len, layers] of each step (keys seen over keys in the sequence, over the KV heads).
    """
    num_variants = len(ctx.rules)
    log_probs, kept = [], []
    for step in range(spec.gen_len):
        position = ctx.start_step()
        token = ids[spec.prompt_len + step].repeat(num_variants)
        hidden = model(token, torch.full((num_variants,), position), ctx)
        log_probs.append(model.compute_logits(hidden).log_softmax(dim=-1))
        kept.append(ctx.visible_counts.double().mean(dim=-1) / ctx.length)
    return torch.stack(log_probs, dim=1), torch.stack(kept, dim=1)
