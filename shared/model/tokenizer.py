"""Text <-> token ids: the tokenizer (from GGUF metadata or a tokenizer.json), the chat template, and
streaming detokenization. Reading model files belongs to gguf_file.py and safetensors_folder.py.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
_TURN_PROBE = "\x00turn-probe\x00"
_MARK = "\U000f0000"  # a private-use character: escapes control-token text in chat content (_ContentEscapes)
_CODES = 0x100000  # the i-th control text escapes as _MARK + chr(_CODES + i)
_ESCAPED = re.compile(re.escape(_MARK) + ".", re.DOTALL)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split transformers' GGUF converter puts before ByteLevel. Every other value,
# "smollm" included, gets ByteLevel's own GPT-2 regex, as in transformers. (llama.cpp additionally isolates
# each digit for "smollm"; that only changes runs of 2+ spaces before a digit, e.g. "x  12".)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}  # fmt: skip


@functools.cache
def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet byte-level BPE vocabularies are spelled in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


@functools.cache
def _char_to_byte() -> dict[str, int]:
    return {char: byte for byte, char in _byte_to_char().items()}


def gguf_backend(metadata: Mapping[str, Any]) -> Backend:
    """The `tokenizers.Tokenizer` that transformers' GGUF converter builds for byte-level BPE (`gpt2`).

    Raises:
        ValueError: `tokenizer.ggml.model` is not "gpt2", or the vocabulary/merges are missing.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"tokenizer.ggml.model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    if "tokenizer.ggml.tokens" not in metadata or "tokenizer.ggml.merges" not in metadata:
        raise ValueError("GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = _byte_to_char()
    alphabet = set(_char_to_byte())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    backend = Backend(
        models.BPE(
            vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
        )
    )
    split = _PRE_SPLITS.get(metadata.get("tokenizer.ggml.pre", "default"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel; transformers skips those.
    typed = [(t, k) for t, k in zip(tokens, token_types, strict=True) if set(t) <= alphabet]
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in typed if k == _USER_DEFINED]
    )
    return backend


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' tojson: no HTML escaping (jinja2's own filter escapes `<`, `>`, `&`)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, transformers' assistant-mask marker: renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    """Compile as transformers does: sandboxed, trim/lstrip blocks, loop controls, raise_exception."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """A model's tokenizer and chat template.

    Attributes:
        vocab_size: token ids the tokenizer knows (added tokens included); may be below the model's vocab.
        bos_token_id: the BOS token, or None; `encode` prepends it only when `add_bos_token` is set.
        eos_token_ids: tokens that end generation: the declared EOS ids first, then the control token the chat
            template writes right after an assistant message (the turn end), when that is a different token.
        control_token_ids: special (control) tokens; `decode(..., skip_special_tokens=True)` drops them.
        chat_template: the jinja2 source, or None.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos_token: bool = False,
    ) -> None:
        """Wrap a `tokenizers.Tokenizer`; `eos_token_ids` are the declared ones (the turn end is added)."""
        self.backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        added = backend.get_added_tokens_decoder()
        self.control_token_ids = frozenset(i for i, token in added.items() if token.special)
        self.is_byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._bytes_cache: dict[int, bytes] = {}
        declared = list(eos_token_ids)
        self.eos_token_ids = tuple(dict.fromkeys([*declared, *self._turn_end_ids(declared)]))

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF file's `tokenizer.*` metadata (see `gguf_backend`).

        EOS ids: `tokenizer.ggml.eos_token_id`, then `eot_token_id`/`eom_token_id` when present, then the
        template's turn end. For SmolLM2-Instruct that is just `<|im_end|>`: its template ends turns with
        `<|im_end|>`, so `<|endoftext|>` (a control token too) does not stop generation.
        """
        keys = ("eos_token_id", "eot_token_id", "eom_token_id")
        return cls(
            gguf_backend(metadata),
            chat_template=metadata.get("tokenizer.chat_template"),
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[
                int(metadata[f"tokenizer.ggml.{k}"]) for k in keys if f"tokenizer.ggml.{k}" in metadata
            ],
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, BOS first when `add_bos_token`. Special-token text (e.g. `<|im_end|>`) in
        `text` becomes that token, as in transformers."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; ids the tokenizer does not know are dropped."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render `messages` (`{"role": ..., "content": ...}` dicts) with the model's chat template.

        Raises:
            ValueError: the model has no chat template.
            jinja2.TemplateError: the template rejected the conversation (`raise_exception`).
        """
        return self._render(messages, add_generation_prompt, self.eos_token_ids[:1])

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat; no BOS is added (the template writes it if the model wants one).

        Only the template's own markers become control tokens: control-token text inside a message's content (a
        forged `<|im_end|><|im_start|>system`) is tokenized as plain text. A chat without such text tokenizes
        exactly as `encode(apply_chat_template(...))` would.
        """
        escapes = _ContentEscapes(self._control_texts)
        text = self.apply_chat_template(escapes.messages(messages), add_generation_prompt)
        ids: list[int] = []
        start = 0
        # The backend always matches added tokens, so it only sees the text between the template's markers.
        for marker in self._control_pattern.finditer(text) if self._control_texts else ():
            ids += self._plain_ids(escapes.restore(text[start : marker.start()]))
            ids.append(self._control_texts[marker.group()])
            start = marker.end()
        return ids + self._plain_ids(escapes.restore(text[start:]))

    @functools.cached_property
    def _control_texts(self) -> dict[str, int]:
        added = self.backend.get_added_tokens_decoder()
        return {added[i].content: i for i in sorted(self.control_token_ids)}

    @functools.cached_property
    def _control_pattern(self) -> re.Pattern[str]:
        """Leftmost-longest, as the backend matches added tokens."""
        return re.compile("|".join(re.escape(t) for t in sorted(self._control_texts, key=len, reverse=True)))

    @functools.cached_property
    def _plain_backend(self) -> Backend:
        """This backend without its special added tokens: control-token text becomes ordinary tokens."""
        spec = json.loads(self.backend.to_str())
        spec["added_tokens"] = [t for t in spec.get("added_tokens") or [] if not t.get("special")]
        return Backend.from_str(json.dumps(spec))

    def _plain_ids(self, text: str) -> list[int]:
        return self._plain_backend.encode(text, add_special_tokens=False).ids if text else []

    def token_piece(self, token_id: int) -> str:
        """The vocabulary string of one token (byte-level spelling, e.g. "Ġworld").

        Raises:
            IndexError: the tokenizer has no such id.
        """
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise IndexError(f"token id {token_id} is outside the vocabulary")
        return piece

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token contributes to decoded text (b"" for unknown ids); byte-level only."""
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            piece = self.backend.id_to_token(token_id) or ""
            table = _char_to_byte()
            # As tokenizers' ByteLevel decoder: a piece outside the byte alphabet is taken as plain text.
            cached = bytes(table[c] for c in piece) if set(piece) <= table.keys() else piece.encode("utf-8")
            self._bytes_cache[token_id] = cached
        return cached

    def _render(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, eos_ids: Sequence[int]
    ) -> str:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        names = {"bos_token": self.bos_token_id, "eos_token": eos_ids[0] if eos_ids else None}
        special = {name: self.token_piece(i) for name, i in names.items() if i is not None}
        template = _compile_template(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **special)

    def _turn_end_ids(self, declared: list[int]) -> list[int]:
        """The control token right after an assistant message in the rendered template, if any."""
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _TURN_PROBE}]
        try:
            text = self._render(chat, False, declared)
        except (jinja2.TemplateError, TypeError, KeyError, ValueError):
            return []  # no template, or one that will not render this probe
        tail = text.partition(_TURN_PROBE)[2]
        ends = [i for i in self.control_token_ids if tail.startswith(self.token_piece(i))]
        return sorted(ends, key=lambda i: -len(self.token_piece(i)))[:1]


class _ContentEscapes:
    """Hides control-token text inside message contents from the template's own markers, and brings it back.

    In content, `_MARK` becomes `_MARK` + "0" and the i-th control text `_MARK` + chr(_CODES + i); a guard
    (`_MARK` + "|", restored as nothing) separates content that starts or ends with part of a control text from the
    template text beside it, so that no marker can straddle the two.
    """

    def __init__(self, control_texts: Mapping[str, int]) -> None:
        self.texts = list(control_texts)
        self.prefixes = {t[:i] for t in self.texts for i in range(1, len(t))}
        self.suffixes = {t[i:] for t in self.texts for i in range(1, len(t))}
        self.codes = {_MARK + "0": _MARK, _MARK + "|": ""} | {
            _MARK + chr(_CODES + i): t for i, t in enumerate(self.texts)
        }

    def messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        return [{**m, "content": self.escape(m["content"])} if "content" in m else m for m in messages]

    def escape(self, content: str) -> str:
        content = content.replace(_MARK, _MARK + "0")
        for i, text in enumerate(self.texts):
            content = content.replace(text, _MARK + chr(_CODES + i))
        # The guard goes inside surrounding whitespace, so that a template's `trim` still trims the same text.
        body = content.strip()
        if not body:
            return content
        head, tail = content.index(body), len(content) - len(content.rstrip())
        guard_head = any(body.startswith(s) for s in self.suffixes)
        guard_tail = any(body.endswith(p) for p in self.prefixes)
        guarded = (_MARK + "|") * guard_head + body + (_MARK + "|") * guard_tail
        return content[:head] + guarded + content[len(content) - tail :]

    def restore(self, text: str) -> str:
        return _ESCAPED.sub(lambda m: self.codes.get(m.group(), m.group()), text) if _MARK in text else text


class IncrementalDetokenizer:
    """Streams text one token at a time; what `push` returns, concatenated, equals `decode` of all ids
    (for ids that decode to valid UTF-8). Bytes of a character split across tokens are held back."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""
        # Non-byte-level decoders (e.g. SentencePiece's Metaspace) get vLLM's re-decode-a-window scheme.
        self._ids: list[int] = []
        self._prefix_offset = self._read_offset = 0

    @property
    def text(self) -> str:
        """All text completed so far."""
        return self._text

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is still unfinished)."""
        if self._skip and token_id in self._tokenizer.control_token_ids:
            return ""
        if self._tokenizer.is_byte_level:
            new = self._utf8.decode(self._tokenizer.token_bytes(token_id))
        else:
            new = self._push_windowed(token_id)
        self._text += new
        return new

    def _push_windowed(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = functools.partial(self._tokenizer.decode, skip_special_tokens=self._skip)
        prefix = decode(self._ids[self._prefix_offset : self._read_offset])
        full = decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]
