"""A FastGen profile on the wire: parts of bounded size, each coded on its own, that reassemble exactly in any order;
a corrupt, conflicting, missing or misshapen part is refused with a clear error."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.wire.handoff.profile import ProfileError, PromptProfile, profile_assembly, profile_of, profile_parts
from shared.wire.parts import PartError

LAYERS, HEADS, TOKENS = 4, 3, 500
POLICIES = 6  # the default ladder's five cheap policies and the full cache


def _profile() -> PromptProfile:
    generator = torch.Generator().manual_seed(0)
    policies = torch.randint(0, POLICIES, (LAYERS, HEADS), generator=generator)
    policies[0, 0] = POLICIES - 1
    return PromptProfile(policies, torch.rand(LAYERS, HEADS, TOKENS, generator=generator) * 40)


def test_parts_reassemble_the_profile_in_any_order() -> None:
    profile = _profile()
    parts = profile_parts("r", profile, part_bytes=4096)
    assert len(parts) > 2 and all(len(p.data) <= 4096 and p.raw_size <= 4096 for p in parts)
    received = profile_assembly("r", len(parts))
    for part in reversed(parts):
        received.add(part)
    back = profile_of(received, LAYERS, HEADS, TOKENS, POLICIES)
    assert torch.equal(back.policies, profile.policies) and torch.equal(back.scores, profile.scores)


def test_bad_parts_are_refused() -> None:
    parts = profile_parts("r", _profile(), part_bytes=4096)
    received = profile_assembly("r", len(parts))
    with pytest.raises(PartError, match="checksum"):
        received.add(dataclasses.replace(parts[0], data=parts[0].data[:-1] + bytes([parts[0].data[-1] ^ 1])))
    received.add(parts[0])
    with pytest.raises(PartError, match=f"profile part 1/{len(parts)} has num_tokens {TOKENS + 1}, the earlier"):
        received.add(dataclasses.replace(parts[1], num_tokens=TOKENS + 1))
    with pytest.raises(ProfileError, match="missing"):
        profile_of(received, LAYERS, HEADS, TOKENS, POLICIES)
    for part in parts:
        received.add(part)
    with pytest.raises(ProfileError, match="is not"):
        profile_of(received, LAYERS, HEADS, TOKENS - 1, POLICIES)
    with pytest.raises(ProfileError, match="bad policy"):  # a prefill on a longer ladder than this decode's
        profile_of(received, LAYERS, HEADS, TOKENS, POLICIES - 1)
