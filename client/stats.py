"""What a client runtime's members did over its life: the counts the runtime keeps (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fedpar.wording import counted


@dataclass
class AgentStats:
    """What an agent did over its life."""

    refusals: list[str] = field(default_factory=list)  # what was refused, and why
    tasks: int = 0
    accepted: int = 0
    refused: int = 0
    dropped: int = 0
    failed: int = 0  # tasks its own side failed: its code raised, it refused the task, the download did not fit
    reconnects: int = 0
    answered: dict[str, int] = field(default_factory=dict)  # a Flower App's replies sent, by message type

    def summary(self) -> str:
        """What the agent did, in the words of its last line: updates, or a Flower App's Messages."""
        if not self.answered:
            return f"{counted(self.tasks, 'task')}, {counted(self.accepted, 'update')} accepted, {self.refused} refused"
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.answered.items()))
        return f"{counted(self.tasks, 'message')}, {sum(self.answered.values())} answered ({kinds}), {self.refused} failed"

    def none_taken(self) -> str | None:
        """Why an agent that had tasks gave not one update (or answer) the coordinator took, its own side having
        failed one at least (what the coordinator refused alone, e.g. a late update or a rank gone, is the
        federation's churn, not the agent's fault): what it did, and the first reason; None when one was taken, when
        none failed here, or when it had no task."""
        if not self.tasks or self.accepted or self.answered or not self.failed:
            return None
        first = f" (the first: {self.refusals[0]})" if self.refusals else ""
        return f"none of its {counted(self.tasks, 'task')} ended in an update the coordinator took{first}"
