"""fedpar.models: architectures, the registry, parallel-friendly GPT layout and numpy weight exchange."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fedpar.models import (
    GPT,
    MLP,
    FedAvgCNN,
    GPTConfig,
    build_model,
    build_model_for_data,
    get_weights,
    model_names,
    set_weights,
    weight_specs,
)

from support.model_size import count_parameters

SMALL_GPT = GPTConfig(vocab_size=17, block_size=16, n_layer=4, n_head=4, d_model=32)


def test_fedavg_cnn_has_the_paper_parameter_count():
    model = FedAvgCNN(in_channels=1, image_size=28, num_classes=10)
    assert count_parameters(model) == 1_663_370
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)


def test_fedavg_cnn_works_on_8x8_digits_and_trains():
    torch.manual_seed(0)
    model = FedAvgCNN(image_size=8)
    # conv params unchanged; fc1 sees 64 channels x 2 x 2 after two poolings
    assert count_parameters(model) == 832 + 51_264 + (256 * 512 + 512) + 5_130
    x, y = torch.randn(8, 1, 8, 8), torch.arange(8) % 10
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(ValueError, match=r"\(batch, 1, 8, 8\)"):
        model(torch.zeros(2, 1, 28, 28))


def test_mlp_flattens_and_checks_width():
    model = MLP(in_features=64, hidden=(32, 16), num_classes=10)
    assert model(torch.zeros(5, 1, 8, 8)).shape == (5, 10)
    assert count_parameters(model) == (64 * 32 + 32) + (32 * 16 + 16) + (16 * 10 + 10)
    with pytest.raises(ValueError, match="expects 64 input features"):
        model(torch.zeros(5, 1, 28, 28))


def test_registry_builds_by_name_and_rejects_unknowns():
    assert model_names() == ["cnn", "gpt", "mlp"]
    assert isinstance(build_model("mlp", in_features=784), MLP)
    assert isinstance(build_model("CNN", image_size=8), FedAvgCNN)
    gpt = build_model("gpt", vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=16)
    assert isinstance(gpt, GPT) and gpt.config.vocab_size == 11
    assert build_model("gpt", config=SMALL_GPT).config == SMALL_GPT
    with pytest.raises(ValueError, match="valid names are: cnn, gpt, mlp"):
        build_model("resnet")
    with pytest.raises(ValueError, match="does not take hidden_units"):
        build_model("mlp", hidden_units=3)
    with pytest.raises(ValueError, match="not both"):
        build_model("gpt", config=SMALL_GPT, n_layer=2)


def test_build_model_for_data_sizes_classifiers_from_the_dataset_shape():
    mlp = build_model_for_data("mlp", (1, 8, 8), 10)
    assert isinstance(mlp, MLP) and mlp(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    cnn = build_model_for_data("cnn", (1, 28, 28), 10)
    assert isinstance(cnn, FedAvgCNN) and count_parameters(cnn) == 1_663_370
    assert build_model_for_data("cnn", (3, 8, 8), 4)(torch.zeros(1, 3, 8, 8)).shape == (1, 4)
    with pytest.raises(ValueError, match="square images"):
        build_model_for_data("cnn", (1, 8, 6), 10)
    with pytest.raises(ValueError, match="use mlp or cnn"):
        build_model_for_data("gpt", (1, 8, 8), 10)


def test_init_is_deterministic_given_the_seed():
    for name, kwargs in [("mlp", {}), ("cnn", {"image_size": 8}), ("gpt", {"config": SMALL_GPT})]:
        torch.manual_seed(7)
        a = get_weights(build_model(name, **kwargs))
        torch.manual_seed(7)
        b = get_weights(build_model(name, **kwargs))
        torch.manual_seed(8)
        c = get_weights(build_model(name, **kwargs))
        assert all(np.array_equal(x, y) for x, y in zip(a, b)), name
        assert not all(np.array_equal(x, z) for x, z in zip(a, c)), name


def test_gpt_shapes_and_block_layout():
    model = GPT(SMALL_GPT)
    tokens = torch.randint(0, 17, (2, 16))
    assert model(tokens).shape == (2, 16, 17)
    assert list(model.layers.keys()) == ["0", "1", "2", "3"]
    names = set(dict(model.named_parameters()))
    for part in ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                 "feed_forward.w2", "attention_norm", "ffn_norm"):
        assert f"layers.0.{part}.weight" in names
    assert {"tok_embeddings.weight", "norm.weight", "output.weight"} <= names
    with pytest.raises(ValueError, match="exceeds block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = GPT(SMALL_GPT).eval()
    tokens = torch.randint(0, 17, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 17
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-3


def _stage(model: GPT, keep: set[str], first: bool, last: bool) -> GPT:
    stage = copy.deepcopy(model)
    for name in list(stage.layers.keys()):
        if name not in keep:
            del stage.layers[name]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    return stage


def test_gpt_split_into_pipeline_stages_matches_the_whole_model():
    torch.manual_seed(0)
    model = GPT(SMALL_GPT).eval()
    tokens = torch.randint(0, 17, (2, 10))
    first = _stage(model, {"0", "1"}, first=True, last=False)
    last = _stage(model, {"2", "3"}, first=False, last=True)
    hidden = first(tokens)
    assert hidden.shape == (2, 10, 32)
    hidden_before = hidden.clone()
    torch.testing.assert_close(last(hidden), model(tokens))
    torch.testing.assert_close(hidden, hidden_before)  # the stage did not modify its input
    full_names = set(model.state_dict())
    assert set(first.state_dict()) | set(last.state_dict()) == full_names
    assert "layers.2.attention.wq.weight" in last.state_dict()  # names stay those of the whole model


def test_gpt_attention_heads_can_be_sharded_like_tensor_parallel():
    # Column-shard wq/wk/wv and row-shard wo over 2 "ranks" by hand; the sum of the partial outputs
    # must equal the full attention, which only works if forward infers the local head count.
    torch.manual_seed(0)
    attn = GPT(SMALL_GPT).layers["0"].attention.eval()
    x = torch.randn(2, 6, 32)
    full = attn(x)
    partial_sum = torch.zeros_like(full)
    for rank in range(2):
        shard = copy.deepcopy(attn)
        rows = slice(rank * 16, (rank + 1) * 16)
        with torch.no_grad():
            for name in ("wq", "wk", "wv"):
                src = getattr(attn, name)
                dst = torch.nn.Linear(32, 16, bias=False)
                dst.weight.copy_(src.weight[rows])
                setattr(shard, name, dst)
            wo = torch.nn.Linear(16, 32, bias=False)
            wo.weight.copy_(attn.wo.weight[:, rows])
            shard.wo = wo
        partial_sum = partial_sum + shard(x)
    torch.testing.assert_close(partial_sum, full)


def test_gpt_trains_with_dropout_and_reinitialises_after_meta():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2, d_model=16, dropout=0.1)
    model = GPT(cfg).train()
    tokens = torch.randint(0, 17, (4, 8))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 17), tokens[:, 1:].reshape(-1))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())

    with torch.device("meta"):
        meta = GPT(cfg)
    meta.to_empty(device="cpu")
    torch.manual_seed(1)
    meta.init_weights()
    assert meta.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.1)
    torch.testing.assert_close(meta.layers["0"].ffn_norm.weight, torch.ones(16))
    assert torch.isfinite(meta.eval()(tokens)).all()


def test_get_and_set_weights_round_trip():
    torch.manual_seed(0)
    a = FedAvgCNN(image_size=8)
    torch.manual_seed(1)
    b = FedAvgCNN(image_size=8)
    x = torch.randn(4, 1, 8, 8)
    weights = get_weights(a)
    assert [w.shape for w in weights] == [tuple(t.shape) for t in a.state_dict().values()]
    assert all(w.flags.c_contiguous and w.dtype == np.float32 for w in weights)
    weights[0][...] = 0.0  # a copy: the model must not change
    assert a.conv1.weight.abs().sum() > 0
    weights = get_weights(a)
    readonly = [np.frombuffer(w.tobytes(), dtype=w.dtype).reshape(w.shape) for w in weights]
    set_weights(b, readonly)
    torch.testing.assert_close(a(x), b(x))


def test_weight_specs_describe_get_weights():
    model = MLP(in_features=4, hidden=(3,), num_classes=2)
    specs = weight_specs(model)
    assert specs == [("net.0.weight", "float32", (3, 4)), ("net.0.bias", "float32", (3,)),
                     ("net.2.weight", "float32", (2, 3)), ("net.2.bias", "float32", (2,))]
    assert [(str(w.dtype), w.shape) for w in get_weights(model)] == [(d, s) for _, d, s in specs]


def test_set_weights_rejects_mismatches_and_leaves_the_model_unchanged():
    model = MLP(in_features=4, hidden=(3,), num_classes=2)
    good = get_weights(model)
    with pytest.raises(ValueError, match="expected 4 weight arrays .* got 3"):
        set_weights(model, good[:3])
    bad_shape = [w + 1 for w in good]
    bad_shape[2] = np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match=r"weight 2 \('net.2.weight'\) has shape \(3, 2\), expected \(2, 3\)"):
        set_weights(model, bad_shape)
    bad_dtype = [w + 1 for w in good]
    bad_dtype[1] = bad_dtype[1].astype(np.float64)
    with pytest.raises(ValueError, match=r"weight 1 \('net.0.bias'\) has dtype float64, expected float32"):
        set_weights(model, bad_dtype)
    assert all(np.array_equal(x, y) for x, y in zip(get_weights(model), good))


def test_model_weights_kept_for_one_model_copy_in_and_out_and_refuse_what_does_not_fit():
    from fedpar.models.weights import ModelWeights

    model = MLP(in_features=4, hidden=(3,), num_classes=2)
    weights = ModelWeights(model)
    first = weights.get()
    with torch.no_grad():
        model.net[0].weight.add_(1.0)  # trained in place: the copies taken before stay as they were
    assert np.array_equal(first[0] + 1.0, weights.get()[0]) and np.array_equal(first[1], weights.get()[1])
    readonly = [np.frombuffer((w * 2).tobytes(), dtype=w.dtype).reshape(w.shape) for w in first]
    strided = [np.asfortranarray(w * 3) for w in first]
    for arrays, factor in ((readonly, 2), (strided, 3)):
        weights.set(arrays)
        assert all(np.array_equal(x, w * factor) for x, w in zip(weights.get(), first))
        assert torch.equal(model.net[2].bias, torch.from_numpy(first[3] * factor))
    out = weights.get()
    out[0][...] = 7.0  # a copy: the model must not change
    assert model.net[0].weight.abs().max() < 7.0
    bad = [w.copy() for w in first]
    bad[2] = np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match=r"weight 2 \('net.2.weight'\) has shape \(3, 2\), expected \(2, 3\)"):
        weights.set(bad)
    bad[2] = first[2].astype(np.float64)
    with pytest.raises(ValueError, match=r"weight 2 \('net.2.weight'\) has dtype float64, expected float32"):
        weights.set(bad)
    with pytest.raises(ValueError, match="must be a numpy array, got list"):
        weights.set([*first[:3], first[3].tolist()])
    assert all(np.array_equal(x, w * 3) for x, w in zip(weights.get(), first))  # the refused lists changed nothing
    with pytest.raises(ValueError, match="numpy cannot hold"):
        ModelWeights(MLP(in_features=4, hidden=(3,), num_classes=2).to(torch.bfloat16)).get()


def test_an_mlp_s_hidden_may_be_one_width():
    # train --model-arg hidden=8 (one hidden layer of 8) was a TypeError traceback
    from fedpar.models.mlp import MLP

    assert [m.out_features for m in MLP(64, 8, 10).net if hasattr(m, "out_features")] == [8, 10]
