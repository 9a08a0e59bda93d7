"""A prompt's FastGen profile on the wire, prefill -> decode: each lane's policy and the prompt's accumulated attention
(what the heavy hitters rank by), cut into `FastGenProfilePart` messages that follow the prompt's KV chunks.

Owns the profile's bytes (`PromptProfile`), its parts, and their reassembly with checks; the scores are shuffled and
LZ4-compressed as KV chunks are (`shared.wire.payload`), and each part is checksummed before anything is decoded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.wire.payload import PayloadError, checksum, compress, decompress
from shared.wire.protocol import FastGenProfilePart

SCORE_BYTES = 4  # float32


class ProfileError(ValueError):
    """Profile parts that do not make up a profile of the expected shape (corrupt, conflicting, wrong size)."""


@dataclass(frozen=True)
class PromptProfile:
    """What FastGen learnt from a prompt: long [num_layers, num_kv_heads] policy ids (`FastGenSettings`), and float32
    [num_layers, num_kv_heads, num_tokens] accumulated attention of the profiled rows."""

    policies: torch.Tensor
    scores: torch.Tensor


def profile_parts(request_id: str, profile: PromptProfile, part_bytes: int) -> list[FastGenProfilePart]:
    """The profile as parts of at most `part_bytes` compressed score bytes each (at least one part)."""
    policies = profile.policies.to(torch.uint8).contiguous().numpy().tobytes()
    raw = profile.scores.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
    codec, data = compress(raw, SCORE_BYTES)
    pieces = [data[i : i + part_bytes] for i in range(0, len(data), part_bytes)] or [b""]
    return [
        FastGenProfilePart(request_id, seq, len(pieces), int(profile.scores.shape[-1]), policies, codec, len(raw),
                           checksum(piece), piece)
        for seq, piece in enumerate(pieces)
    ]


class ProfileParts:
    """A decode instance's profiles in flight: parts in, whole profiles out."""

    def __init__(self) -> None:
        self._parts: dict[str, dict[int, FastGenProfilePart]] = {}

    def add(self, part: FastGenProfilePart) -> None:
        """Take one part. Raises ProfileError: a failed checksum, or a part that disagrees with the others."""
        if checksum(part.data) != part.checksum:
            raise ProfileError(f"FastGen profile part {part.seq} of {part.request_id} failed its checksum")
        parts = self._parts.setdefault(part.request_id, {})
        first = next(iter(parts.values()), part)
        if not 0 <= part.seq < part.total or (part.total, part.num_tokens, part.policies, part.codec,
                                               part.raw_size) != (first.total, first.num_tokens, first.policies,
                                                                  first.codec, first.raw_size):
            raise ProfileError(f"FastGen profile part {part.seq} of {part.request_id} disagrees with its others")
        parts[part.seq] = part

    def num_received(self, request_id: str) -> int:
        return len(self._parts.get(request_id, {}))

    def take(
        self, request_id: str, num_layers: int, num_kv_heads: int, num_tokens: int, num_policies: int
    ) -> PromptProfile:
        """Pop a request's whole profile; its policy ids must be below `num_policies` (the full cache's id + 1).

        Raises:
            ProfileError: parts missing, or a profile that is not of this shape (or does not decode).
        """
        parts = self._parts.pop(request_id, {})
        first = next(iter(parts.values()), None)
        if first is None or len(parts) != first.total:
            raise ProfileError(f"FastGen profile of {request_id}: {len(parts)} parts received")
        lanes = num_layers * num_kv_heads
        if first.num_tokens != num_tokens or len(first.policies) != lanes:
            raise ProfileError(f"FastGen profile of {request_id} is not {num_layers}x{num_kv_heads} x {num_tokens}")
        try:
            raw = decompress(first.codec, b"".join(parts[i].data for i in range(first.total)), first.raw_size,
                             SCORE_BYTES)
        except PayloadError as exc:
            raise ProfileError(f"FastGen profile of {request_id}: {exc}") from None
        if not isinstance(raw, bytes) or len(raw) != lanes * num_tokens * SCORE_BYTES or max(
            first.policies
        ) >= num_policies:
            raise ProfileError(f"FastGen profile of {request_id} holds {len(raw)} score bytes or a bad policy")
        scores = torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy())
        policies = torch.tensor(list(first.policies), dtype=torch.long)
        return PromptProfile(policies.view(num_layers, num_kv_heads), scores.view(num_layers, num_kv_heads, -1))

    def discard(self, request_id: str) -> None:
        self._parts.pop(request_id, None)
