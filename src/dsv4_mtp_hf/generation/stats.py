"""Acceptance statistics of one `target.generate(..., assistant_model=mtp)` call."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    num_assistant_tokens: int  # drafts per round; with ``auto``, the most a round may have
    auto: bool = False  # num_assistant_tokens="auto": each round's K in ``draft_lengths``
    rounds: int = 0  # verify rounds in which the MTP proposed at least one token
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the target accepted
    new_tokens: int = 0  # tokens added to the output, bonus tokens included
    rounds_stopped_by_processor: int = 0  # rounds cut short: no token allowed at a draft position
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)  # "auto": the K chosen for each round (0: a plain step)

    def record_round(self, drafted: int, accepted: int, new_tokens: int) -> None:
        self.new_tokens += new_tokens
        if drafted == 0:
            return
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        grow = drafted - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for i in range(drafted):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += int(i < accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Fraction of rounds whose i-th draft was accepted, among rounds that drafted it."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verify round, the target's bonus token included."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def mean_verified_length(self) -> float:
        """Drafts sent to the target per verify round (with ``auto``, DSpark's confidence cut, or an EOS/length
        cut, below ``num_assistant_tokens``)."""
        return self.drafted / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        return {
            "num_assistant_tokens": "auto" if self.auto else self.num_assistant_tokens,
            "draft_lengths": list(self.draft_lengths),
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "new_tokens": self.new_tokens,
            "rounds_stopped_by_processor": self.rounds_stopped_by_processor,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_by_position": self.acceptance_by_position,
            "mean_accepted_length": self.mean_accepted_length,
            "mean_verified_length": self.mean_verified_length,
        }

    def __str__(self) -> str:
        by_pos = ", ".join(f"{p:.2f}" for p in self.acceptance_by_position)
        return (
            f"rounds={self.rounds} drafted={self.drafted} accepted={self.accepted} "
            f"mean_accepted_length={self.mean_accepted_length:.2f} acceptance_by_position=[{by_pos}]"
        )


class BatchGenerationStats(list):
    """Per-sequence :class:`GenerationStats` of a batched call (a list), with the batch's totals."""

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self)

    @property
    def rounds(self) -> int:
        return sum(s.rounds for s in self)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verify round over all sequences, the target's token included."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0
