"""What speculative decoding counts (`SpeculationTotals`): vLLM's numbers, drafts, drafted tokens,
accepted tokens in all and by position, and the mean acceptance length (1 + accepted / drafts),
which /metrics exports (cairn.workers.engine_metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cairn.workers.engine_options import MAX_SPECULATIVE_TOKENS


@dataclass
class SpeculationTotals:
    drafts: int = 0  # verify segments with at least one drafted token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=lambda: [0] * MAX_SPECULATIVE_TOKENS)

    def count(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.drafts += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            for j in range(accepted):
                self.accepted_by_position[j] += 1

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verify step yields on average: 1 + accepted / drafts (None before any)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None
