"""digits-app: the ClientApp (Flower's Message API)."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from digits_app.task import Net, load_data
from digits_app.task import test as test_fn
from digits_app.task import train as train_fn

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the model it is sent on this node's partition."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    partition_id = context.node_config["partition-id"]
    trainset, _ = load_data(partition_id, context.node_config["num-partitions"])
    server_round = int(msg.content["config"]["server-round"])
    train_loss = train_fn(model, trainset, int(context.run_config["local-epochs"]), float(msg.content["config"]["lr"]),
                          int(context.run_config["batch-size"]), seed=1000 * server_round + partition_id)
    # the node's own record across rounds, kept in its Context.state
    rounds = context.state.get("history", MetricRecord({"rounds-trained": 0}))
    rounds["rounds-trained"] = int(rounds["rounds-trained"]) + 1
    context.state["history"] = rounds
    metrics = MetricRecord({"train_loss": train_loss, "num-examples": len(trainset[1]),
                            "rounds-trained": rounds["rounds-trained"]})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the model it is sent on this node's validation split."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, valset = load_data(context.node_config["partition-id"], context.node_config["num-partitions"])
    eval_loss, eval_acc = test_fn(model, valset)
    metrics = MetricRecord({"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(valset[1])})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
