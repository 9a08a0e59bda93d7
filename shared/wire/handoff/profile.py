"""A prompt's FastGen profile on the wire, prefill -> decode: each lane's policy and the prompt's accumulated attention
(what the heavy hitters rank by), cut into `FastGenProfilePart` messages that follow the prompt's KV chunks.

Owns the profile's bytes (`PromptProfile`), its parts, and their reassembly with checks; the parts are checksummed
parts (`shared.wire.parts`), the scores shuffled and LZ4-compressed as KV chunks are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
import torch

from shared.wire.parts import PartAssembly, PartError, cut_payload, shuffle_width
from shared.wire.payload import join
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
    """The profile as parts of at most `part_bytes` score bytes each (at least one part), each coded on its own."""
    policies = profile.policies.to(torch.uint8).contiguous().numpy().tobytes()
    raw = profile.scores.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
    bodies = cut_payload(raw, part_bytes, SCORE_BYTES, align_bytes=SCORE_BYTES)
    num_tokens = int(profile.scores.shape[-1])
    return [
        FastGenProfilePart(request_id, seq, len(bodies), num_tokens, policies, **body.fields())
        for seq, body in enumerate(bodies)
    ]


ProfileAssembly = PartAssembly[FastGenProfilePart]


def profile_assembly(request_id: str, total: int, clock: Callable[[], float] = time.monotonic) -> ProfileAssembly:
    """The assembly of a profile's `total` parts: every part must repeat the same token count and policies.

    Raises:
        PartError: `total` < 1.
    """
    return PartAssembly(f"request {request_id}: FastGen profile", total,
                        _profile_agreed, lambda part: shuffle_width(part.raw_size, SCORE_BYTES), clock=clock)


def _profile_agreed(part: FastGenProfilePart) -> dict[str, Hashable]:
    return {"request_id": part.request_id, "num_tokens": part.num_tokens, "policies": part.policies}


def profile_of(
    assembly: ProfileAssembly, num_layers: int, num_kv_heads: int, num_tokens: int, num_policies: int
) -> PromptProfile:
    """The whole profile of a complete assembly; its policy ids must be below `num_policies` (the full cache's id + 1).

    Raises:
        ProfileError: parts missing, or a profile that is not of this shape.
    """
    try:
        assembly.check_complete()
    except PartError as exc:
        raise ProfileError(str(exc)) from None
    pieces = assembly.pieces()
    first, what = pieces[0][0], assembly.what
    lanes = num_layers * num_kv_heads
    if first.num_tokens != num_tokens or len(first.policies) != lanes:
        raise ProfileError(f"{what} is not {num_layers}x{num_kv_heads} x {num_tokens}")
    raw = join([piece for _, piece in pieces])
    if not isinstance(raw, bytes):
        raise ProfileError(f"{what} carries sizes, not scores")
    if len(raw) != lanes * num_tokens * SCORE_BYTES or max(first.policies) >= num_policies:
        raise ProfileError(f"{what} holds {len(raw)} score bytes or a bad policy")
    scores = torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy())
    policies = torch.tensor(list(first.policies), dtype=torch.long)
    return PromptProfile(policies.view(num_layers, num_kv_heads), scores.view(num_layers, num_kv_heads, -1))
