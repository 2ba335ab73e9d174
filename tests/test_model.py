"""Layers: shapes, the loss at init, and every gradient against central finite differences."""

import numpy as np
import pytest

from fsdp_lesson.config import ModelConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.model import MLP, loss_and_grads
from fsdp_lesson.rng import make_rng


@pytest.fixture(scope="module")
def data():
    return Dataset.load()


def test_layers_and_shapes():
    model = MLP(ModelConfig())
    assert [layer.name for layer in model.layers] == ["emb", "fc1", "relu1", "fc2"]
    params = model.init_params(make_rng(42))
    assert params["emb"]["W"].shape == (27, 16)
    assert params["fc1"]["W"].shape == (256, 64) and params["fc1"]["b"].shape == (64,)
    assert params["fc2"]["W"].shape == (64, 27) and params["fc2"]["b"].shape == (27,)
    assert model.num_params == 18_635
    assert all(a.dtype == np.float32 for p in params.values() for a in p.values())


def test_deeper_model_has_hidden_blocks():
    model = MLP(ModelConfig(layers=3, hidden=8))
    names = [layer.name for layer in model.layers]
    assert names == ["emb", "fc1", "relu1", "fc2", "relu2", "fc3", "relu3", "fc4"]
    assert model.layers[3].shapes == {"W": (8, 8), "b": (8,)}


def test_init_is_uniform_in_plus_minus_k():
    params = MLP(ModelConfig()).init_params(make_rng(0))
    assert np.abs(params["fc1"]["W"]).max() <= 1 / 256
    assert np.abs(params["emb"]["W"]).max() <= 1 / 16
    assert np.abs(params["fc1"]["W"]).max() > 0.9 / 256  # fills the range


def test_loss_at_init_is_about_ln_vocab(data):
    model = MLP(ModelConfig())
    loss, _ = loss_and_grads(
        model, model.init_params(make_rng(42)), data.X_train[:256], data.Y_train[:256]
    )
    assert abs(loss - np.log(27)) < 0.01


@pytest.mark.parametrize("config", [ModelConfig(), ModelConfig(emb=4, hidden=6, layers=3)])
def test_every_gradient_matches_central_differences(data, config):
    """Per tensor, in float64: |num - ana| / (|num| + |ana|) <= 1e-6, with 2-norms."""
    model = MLP(config)
    params = model.init_params(make_rng(1), dtype=np.float64)
    for p in params.values():  # larger weights than init, so that every ReLU and logit matters
        for a in p.values():
            a *= 20
    X, Y = data.X_train[1000:1016], data.Y_train[1000:1016]
    _, grads = loss_and_grads(model, params, X, Y)
    h = 1e-6
    for layer, p in params.items():
        for name, a in p.items():
            numeric = np.zeros_like(a)
            flat, nflat = a.reshape(-1), numeric.reshape(-1)
            for i in range(flat.size):
                old = flat[i]
                flat[i] = old + h
                plus, _ = loss_and_grads(model, params, X, Y)
                flat[i] = old - h
                minus, _ = loss_and_grads(model, params, X, Y)
                flat[i] = old
                nflat[i] = (plus - minus) / (2 * h)
            analytic = grads[layer][name]
            rel = np.linalg.norm(numeric - analytic) / (
                np.linalg.norm(numeric) + np.linalg.norm(analytic)
            )
            assert rel <= 1e-6, f"{layer}.{name}: relative error {rel:.2e}"
            assert np.linalg.norm(analytic) > 0, f"{layer}.{name} has an all-zero gradient"
