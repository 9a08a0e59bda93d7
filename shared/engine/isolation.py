"""Finding the request that makes engine steps fail, so that it alone fails and the batch goes on.

A step that raises leaves the step's sequences under suspicion: the engine recomputes them, in halves, one half per
step (bisection), until a step of a single sequence fails (that one is the culprit) or every half passes (the fault
was passing). Pure bookkeeping: the engine plans and runs the steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_CONSECUTIVE_FAILURES = 16  # failed steps in a row (no step passing between) after which the engine is broken


@dataclass
class FailureIsolation:
    """The groups of suspect request ids still to test, the top one first, and how many steps failed in a row.

    Attributes:
        groups: a stack; while it is not empty a step runs only the top group's sequences.
        num_consecutive_failures: steps failed since the last one that passed.
        max_consecutive_failures: at this many the engine counts as broken (`is_broken`).
    """

    groups: list[set[str]] = field(default_factory=list)
    num_consecutive_failures: int = 0
    max_consecutive_failures: int = MAX_CONSECUTIVE_FAILURES

    @property
    def is_broken(self) -> bool:
        """So many steps failed in a row that the fault is the engine's (its device, say), not one request's."""
        return self.num_consecutive_failures >= self.max_consecutive_failures

    def restriction(self, live_ids: set[str]) -> set[str] | None:
        """The ids the next step may run (None: any). Groups whose requests all ended meanwhile are dropped."""
        while self.groups:
            group = self.groups[-1] & live_ids
            if group:
                self.groups[-1] = group
                return group
            self.groups.pop()
        return None

    def passed(self, restriction: set[str] | None, ran_ids: set[str]) -> None:
        """A step ran `ran_ids` without raising: they are cleared (a restricted group that ran whole is done)."""
        self.num_consecutive_failures = 0
        if restriction is not None and self.groups and self.groups[-1] is restriction:
            rest = restriction - ran_ids
            if rest:
                self.groups[-1] = rest
            else:
                self.groups.pop()

    def failed(self, restriction: set[str] | None, ran_ids: list[str]) -> str | None:
        """A step of `ran_ids` (in plan order) raised. Returns the culprit when it ran alone (the caller fails it);
        otherwise splits the step's ids into two groups to test, the first half next, and returns None (the caller
        recomputes them)."""
        self.num_consecutive_failures += 1
        if restriction is not None and self.groups and self.groups[-1] is restriction:
            untested = restriction - set(ran_ids)
            self.groups.pop()
            if untested:
                self.groups.append(untested)
        if len(ran_ids) == 1:
            return ran_ids[0]
        half = len(ran_ids) // 2
        self.groups += [set(ran_ids[half:]), set(ran_ids[:half])]
        return None
