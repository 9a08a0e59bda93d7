"""From a validated request to what the scheduler needs: prompt token ids, their block hashes, its sampling.

Owns the chat template call, the context-length check and the cap of `max_tokens` by the context; not HTTP, not NATS.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jinja2

from services.gateway.errors import bad_request
from services.gateway.openai_api import ChatRequest, CompletionRequest, GenerationOptions
from shared.model.tokenizer import Tokenizer
from shared.wire.block_hash import block_hashes, make_namespace
from shared.wire.protocol import SamplingError, SamplingParams


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway knows about the served model.

    Args:
        name: the model id clients must send (`TSUKIMI_MODEL_NAME`).
        tokenizer: the model's tokenizer and chat template.
        fingerprint: the checkpoint fingerprint (seeds the block-hash namespace).
        context_len: most tokens of prompt plus output (`max_position`).
        vocab_size: token ids a completions prompt may hold are below this.
        kv_format: the engines' KV storage format (`EngineConfig.kv_format`), part of the block-hash namespace:
            the gateway's hashes must equal the ones prefill computes.
        is_simulated: the engines are the sim backend (`/health` and the logs say so).
    """

    name: str
    tokenizer: Tokenizer
    fingerprint: str
    context_len: int
    vocab_size: int
    kv_format: str
    is_simulated: bool = False


@dataclass(frozen=True)
class PreparedPrompt:
    prompt_ids: list[int]
    block_hashes: list[int]
    sampling: SamplingParams


class PromptBuilder:
    """Tokenizes requests and checks them against the model's limits.

    Args:
        model: the served model.
        block_size: tokens per KV block (`TSUKIMI_BLOCK_SIZE`), for the block hashes.
    """

    def __init__(self, model: ModelInfo, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.namespace = make_namespace(model.fingerprint, model.kv_format)

    def chat(self, request: ChatRequest) -> PreparedPrompt:
        """Raises ApiError (400): the template rejected the conversation, or it does not fit the context."""
        try:
            ids = self.model.tokenizer.encode_chat(request.messages, add_generation_prompt=True)
        except (jinja2.TemplateError, ValueError) as exc:
            raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None
        return self._prepare(ids, request.options, "messages")

    def completion(self, request: CompletionRequest) -> PreparedPrompt:
        """Raises ApiError (400): a token id outside the vocabulary, or a prompt that does not fit the context."""
        if isinstance(request.prompt, str):
            ids = self.model.tokenizer.encode(request.prompt)
        else:
            ids = request.prompt
            bad = next((t for t in ids if t >= self.model.vocab_size), None)
            if bad is not None:
                raise bad_request(f"token id {bad} is outside the vocabulary ({self.model.vocab_size})", "prompt")
        return self._prepare(ids, request.options, "prompt")

    def _prepare(self, ids: list[int], options: GenerationOptions, prompt_param: str) -> PreparedPrompt:
        if not ids:
            raise bad_request("the prompt is empty after tokenization", prompt_param)
        room = self.model.context_len - len(ids)
        if room < 1:
            raise bad_request(
                f"the prompt has {len(ids)} tokens; the context holds {self.model.context_len} tokens in all",
                prompt_param, "context_length_exceeded",
            )
        sampling, max_tokens = options.sampling, options.max_tokens
        if max_tokens is None and sampling.max_tokens > room:
            try:
                sampling = replace(sampling, max_tokens=room)
            except SamplingError as exc:  # min_tokens beyond what the context leaves
                raise bad_request(str(exc), exc.field) from None
        elif max_tokens is not None and max_tokens > room:
            raise bad_request(
                f"{len(ids)} prompt tokens plus max_tokens={max_tokens} exceed the context of "
                f"{self.model.context_len} tokens", "max_tokens", "context_length_exceeded",
            )
        return PreparedPrompt(ids, self.hashes(ids), sampling)

    def hashes(self, ids: list[int]) -> list[int]:
        """The block hashes of a prompt of these token ids (its full blocks)."""
        return block_hashes(ids, self.block_size, self.namespace)
