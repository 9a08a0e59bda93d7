"""Our GGUF loading against transformers loading the same file: token ids, chat rendering, every weight."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from shared.model.checkpoint import Checkpoint, load_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.slow

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It wasn't me, they'll say!",
    'def fib(n: int) -> int:\n    """Fibonacci."""\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n',
    "Pi is 3.14159;  2**64 = 18446744073709551616, 1,000,000 and -42.5e-3 (2024-11-29).",
    "日本語のテキスト、東京タワー。Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 — Ünïcödé ñ € ½",
    "a  b   c\n\n\n\td\t\t e    \r\n  trailing   ",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Colour of the sky?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And at night? 🌙"},
    ],
]


@pytest.fixture(scope="module")
def ours() -> Checkpoint:
    return load_checkpoint()


@pytest.fixture(scope="module")
def hf_tokenizer(ours: Checkpoint) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ours.path.parent), gguf_file=ours.path.name)


@pytest.fixture(scope="module")
def hf_gguf_model(ours: Checkpoint) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(ours.path.parent), gguf_file=ours.path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.mark.parametrize("text", TEXTS + ["<|im_start|>user\nHi<|im_end|>\n<|endoftext|>"])
def test_token_ids_match_transformers(ours: Checkpoint, hf_tokenizer: Any, text: str) -> None:
    expected = hf_tokenizer(text, add_special_tokens=True)["input_ids"]  # add_bos_token is False: no BOS
    assert ours.tokenizer.encode(text) == expected
    for skip in (True, False):
        assert ours.tokenizer.decode(expected, skip) == hf_tokenizer.decode(
            expected, skip_special_tokens=skip
        )


@pytest.mark.parametrize("chat", CHATS)
def test_chat_rendering_and_ids_match_transformers(ours: Checkpoint, hf_tokenizer: Any, chat: Any) -> None:
    rendered = hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.tokenizer.apply_chat_template(chat) == rendered
    assert ours.tokenizer.encode_chat(chat) == hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    no_prompt = hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
    assert ours.tokenizer.apply_chat_template(chat, add_generation_prompt=False) == no_prompt


def test_special_tokens_match_transformers(ours: Checkpoint, hf_tokenizer: Any) -> None:
    assert ours.tokenizer.bos_token_id == hf_tokenizer.bos_token_id
    assert ours.tokenizer.eos_token_ids[0] == hf_tokenizer.eos_token_id
    assert ours.tokenizer.vocab_size == len(hf_tokenizer)


def test_config_matches_transformers(ours: Checkpoint, hf_gguf_model: Any) -> None:
    hf = hf_gguf_model.config
    config = ours.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers) == (
        hf.vocab_size,
        hf.hidden_size,
        hf.intermediate_size,
        hf.num_hidden_layers,
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        hf.head_dim,
    )
    assert config.rope_theta == hf.rope_parameters["rope_theta"] and config.rms_norm_eps == hf.rms_norm_eps
    assert config.max_position == hf.max_position_embeddings
    assert config.tie_word_embeddings == hf.tie_word_embeddings


def test_every_weight_is_bitwise_equal_to_transformers(ours: Checkpoint, hf_gguf_model: Any) -> None:
    reference = hf_gguf_model.state_dict()
    assert ours.state_dict.keys() == reference.keys() - {"lm_head.weight"}  # tied: no separate lm_head
    for name, tensor in ours.state_dict.items():
        assert tensor.dtype == reference[name].dtype == torch.float32
        assert torch.equal(tensor, reference[name]), name  # atol 0; Q/K rows un-permuted like HF
    assert torch.equal(reference["lm_head.weight"], ours.state_dict["model.embed_tokens.weight"])
