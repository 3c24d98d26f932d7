"""The tiny app's ClientApp (Flower's Message API)."""

from __future__ import annotations

import time

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from tiny_flower_app.task import loss_of, train as train_fn

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the arrays it is sent on this node's partition; count its rounds in the node's Context.state."""
    arrays = msg.content["arrays"].to_numpy_ndarrays()
    names = list(msg.content["arrays"].keys())
    partition_id = int(context.node_config["partition-id"])
    if context.run_config.get("fail-partition", -1) == partition_id:
        raise RuntimeError("this partition fails on purpose")
    time.sleep(float(context.run_config.get("train-seconds", 0.0)))
    new, loss, examples = train_fn(dict(zip(names, arrays)), partition_id, float(msg.content["config"]["lr"]),
                                   int(context.run_config["local-steps"]))
    if context.run_config.get("nan-partition", -1) == partition_id:
        new = {n: a * float("nan") for n, a in new.items()}
    history = context.state.get("history", MetricRecord({"rounds": 0}))
    history["rounds"] = int(history["rounds"]) + 1
    context.state["history"] = history
    metrics = MetricRecord({"train_loss": loss, "num-examples": examples, "rounds": history["rounds"]})
    padding = int(context.run_config.get("pad-reply", 0))
    if padding:
        new["pad"] = np.zeros(padding, np.float32)
    return Message(RecordDict({"arrays": ArrayRecord({n: Array(a) for n, a in new.items()}), "metrics": metrics}),
                   reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """The loss of the arrays it is sent on this node's partition."""
    record = msg.content["arrays"]
    loss, examples = loss_of(dict(zip(record.keys(), record.to_numpy_ndarrays())),
                             int(context.node_config["partition-id"]))
    return Message(RecordDict({"metrics": MetricRecord({"eval_loss": loss, "num-examples": examples})}),
                   reply_to=msg)
