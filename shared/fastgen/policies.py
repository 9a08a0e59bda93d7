"""FastGen's policies, cheapest first, and their settings: the ladder of policies and their names, and
`FastGenSettings` with its validation. No torch: every role's settings read it. Which vocabulary ids are special or
punctuation is `token_classes`'; what each policy keeps is `kept`'s; which policy a head gets is `profile`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from shared.env_vars import default, default_float


@dataclass(frozen=True)
class Rung:
    """A cheap policy: the special tokens, plus what its fields add. A policy id is a rung's index in
    `FastGenSettings.ladder`; the id one past the last rung is the full cache (`FastGenSettings.full`).

    Attributes:
        punct: keep punctuation too.
        r_frequent: keep the top r_f of the length by accumulated attention (heavy hitters); 0 keeps none.
        r_local: keep the most recent r_l of the length; 0 keeps none.
    """

    punct: bool = False
    r_frequent: float = 0.0
    r_local: float = 0.0

    def label(self, window_width: bool) -> str:
        """The name in reports, e.g. "special+punct+frequent+local", with "@0.5" after "local" if `window_width`."""
        parts = ["special"] + ["punct"] * self.punct + ["frequent"] * (self.r_frequent > 0)
        if self.r_local > 0:
            parts.append(f"local@{self.r_local:g}" if window_width else "local")
        return "+".join(parts)


FULL_LABEL = "full"
PAPER_WIDER_LOCAL: tuple[float, ...] = ()  # the FastGen paper's ladder: no wider windows, heavy hitters alone a rung


def parse_shares(text: str) -> tuple[float, ...]:
    """"0.5,0.7" -> (0.5, 0.7); "" or "none" -> (). Raises ValueError: an item that is not a number."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(float(item) for item in text.split(","))
    except ValueError:
        raise ValueError(f"expected shares like 0.5,0.7 (or none), got {text!r}") from None


TSUKIMI_WIDER_LOCAL = parse_shares(default("TSUKIMI_FASTGEN_WIDER_LOCAL"))  # ours: the window widens twice before
# the full cache; no heavy hitters alone


@dataclass(frozen=True)
class FastGenSettings:
    """How FastGen profiles and keeps.

    The ladder of policies, cheapest first: special tokens; + punctuation; + heavy hitters (only with
    `frequent_alone`); + heavy hitters + the window r_l; the same with each wider window in `wider_local`; full. The
    paper's ladder is `wider_local=()`, `frequent_alone=True`. Ours differs because on SmolLM2 a head served by heavy
    hitters alone loses more than its attention mass says (the recent tokens it drops matter more than their mass),
    and a head a 30% window cannot serve often needs only a wider one, not everything (README, FastGen).

    Attributes:
        threshold: T, the share of the attention mass a head's kept keys must recover, in (0, 1].
        r_local: the local window, a share of the current length, in [0, 1].
        r_frequent: the heavy-hitter budget, a share of the current length, in [0, 1].
        profile_rows: profile on the prompt's last W query rows; None profiles every row.
        wider_local: wider windows, increasing, each above r_l and at most 1, each a rung with the heavy hitters.
        frequent_alone: whether heavy hitters without the window are a rung.
    Raises:
        ValueError: a value out of range.
    """

    threshold: float = default_float("TSUKIMI_FASTGEN_T")
    r_local: float = default_float("TSUKIMI_FASTGEN_R_LOCAL")
    r_frequent: float = default_float("TSUKIMI_FASTGEN_R_FREQUENT")
    profile_rows: int | None = None
    wider_local: tuple[float, ...] = TSUKIMI_WIDER_LOCAL
    frequent_alone: bool = default("TSUKIMI_FASTGEN_FREQUENT_ALONE") == "on"

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ValueError(f"the threshold T must be in (0, 1], got {self.threshold}")
        for name, ratio in (("r_local", self.r_local), ("r_frequent", self.r_frequent)):
            if not 0 <= ratio <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {ratio}")
        if self.profile_rows is not None and self.profile_rows < 1:
            raise ValueError(f"profile_rows must be at least 1 (or None for every row), got {self.profile_rows}")
        widths = (self.r_local, *self.wider_local)
        if any(not a < b for a, b in zip(widths, widths[1:], strict=False)) or widths[-1] > 1:
            raise ValueError(f"wider_local must increase from above r_local={self.r_local} to at most 1, got "
                             f"{list(self.wider_local)} (--wider-local, TSUKIMI_FASTGEN_WIDER_LOCAL; none for no "
                             f"wider window)")

    @cached_property
    def ladder(self) -> tuple[Rung, ...]:
        """The cheap policies, cheapest first; each keeps what the one before keeps and more (built once: every
        decode step's eviction reads it)."""
        rungs = [Rung(), Rung(punct=True)]
        if self.frequent_alone:
            rungs.append(Rung(True, self.r_frequent))
        rungs.extend(Rung(True, self.r_frequent, width) for width in (self.r_local, *self.wider_local))
        return tuple(rungs)

    @property
    def full(self) -> int:
        """The policy id of the full cache: one past the last rung."""
        return len(self.ladder)

    def labels(self) -> list[str]:
        """Every policy's name, indexed by policy id, the full cache last."""
        return [rung.label(bool(self.wider_local)) for rung in self.ladder] + [FULL_LABEL]
