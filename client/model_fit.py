"""Whether the coordinator's model fits the one this agent's task builds: a download whose layout (tensor names,
shapes, dtypes) is not the agent's can never be trained, whatever the round, so it is said in words of both sides and
a deployed agent stops (client/runtime.py)."""

from __future__ import annotations

from fedpar.protocol.codec import CodecError, ModelLayout, one_line

# The start of the reason an agent tells the coordinator with (cli/user_errors.py words a run's end from it).
MODEL_DIFFERS = "model does not fit the coordinator's"
RESTART = ("start the agent with the coordinator's task and --task-option values (a Flower App: the one the "
           "coordinator's serve --flower-app runs)")


class ModelMismatch(CodecError):
    """The coordinator's model (``theirs``, as the download's header announced it) is not ``ours``, the model this
    agent's task builds."""

    def __init__(self, theirs: ModelLayout, ours: ModelLayout):
        self.theirs, self.ours = theirs, ours
        super().__init__(f"the coordinator's model does not fit this agent's task: {self.difference('there', 'here')}")

    def difference(self, coordinator: str, agent: str) -> str:
        """The first difference, the coordinator's side named ``coordinator`` and the agent's ``agent``."""
        if len(self.theirs.tensors) != len(self.ours.tensors):
            return f"{len(self.theirs.tensors)} tensors {coordinator}, {len(self.ours.tensors)} {agent}"
        for theirs, ours in zip(self.theirs.tensors, self.ours.tensors):
            if theirs.name != ours.name:
                return f"tensor {_said(theirs.name)} {coordinator} is {_said(ours.name)} {agent}"
            if (theirs.dtype, theirs.shape) != (ours.dtype, ours.shape):
                meaning = self._in_data_terms(theirs, ours, coordinator, agent)
                return (f"tensor {_said(theirs.name)} is {theirs.dtype}{list(theirs.shape)} {coordinator}, "
                        f"{ours.dtype}{list(ours.shape)} {agent}{meaning}")
        return "their tensors differ"

    def _in_data_terms(self, theirs, ours, coordinator: str, agent: str) -> str:
        """What a difference in the first layer's inputs or the last layer's outputs says of the agent's data (a
        table of other columns, or labels to another largest class); "" for any other difference."""
        if theirs.dtype != ours.dtype or len(theirs.shape) != 2 or len(ours.shape) != 2:
            return ""
        index = next(i for i, t in enumerate(self.ours.tensors) if t.name == ours.name)
        last = len(self.ours.tensors) - (2 if len(self.ours.tensors[-1].shape) == 1 else 1)  # a bias after it
        if index == 0 and theirs.shape[0] == ours.shape[0]:
            return (f" (the first layer takes {theirs.shape[1]} inputs {coordinator}, {ours.shape[1]} {agent}: the "
                    "agent's data has other features, e.g. a table of other columns)")
        if index == last and theirs.shape[1] == ours.shape[1]:
            return (f" (the last layer gives {theirs.shape[0]} outputs {coordinator}, {ours.shape[0]} {agent}: the "
                    "agent's labels run to another largest class number; every site numbers the classes alike, "
                    "0..K-1, with class K-1 in its data)")
        return ""

    def reason(self) -> str:
        """The failure the agent tells the coordinator with (the coordinator says it as this agent's)."""
        return (f"{MODEL_DIFFERS}: {self.difference('at the coordinator', 'at the agent')} (the agent's task or "
                "--task-option values differ)")

    def refusal(self, agent_id: str) -> str:
        """The agent's one line as it stops."""
        return f"{agent_id}: {self}; {RESTART}"


def _said(name: str) -> str:
    """A tensor's name as a line may quote it (the coordinator's may be long, or hold escapes)."""
    return one_line(repr(name), 80)


def fitting_layout(layout: ModelLayout, expected: ModelLayout) -> ModelLayout:
    """``layout``, the coordinator's model as a download announced it, which must be ``expected``, this agent's
    (ModelMismatch naming the difference)."""
    if layout != expected:
        raise ModelMismatch(layout, expected)
    return layout
