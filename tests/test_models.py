"""The model zoo: every model builds and runs on the digits, MNIST and CIFAR shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parambox.errors import UserError
from parambox.models import MODELS, build_model, count_parameters
from parambox.models.resnet import BasicBlock

SHAPES = {"digits": (1, 8, 8), "mnist": (1, 28, 28), "cifar10": (3, 32, 32)}
ZOO = ["neuron", "logreg", "mlp", "lenet", "cnn", "alexnet", "vgg16", "resnet18"]


def test_zoo_is_registered():
    build_model("logreg", (4,), 2)  # triggers registration
    assert set(ZOO) <= set(MODELS)


LARGE = {"alexnet", "vgg16", "resnet18"}  # millions of parameters: two shapes cover their branches
CASES = [(name, shape) for name in ZOO for shape in SHAPES if name not in LARGE or shape != "mnist"]


@pytest.mark.parametrize(("name", "shape_name"), CASES)
def test_model_builds_and_runs(name, shape_name):
    shape = SHAPES[shape_name]
    num_classes = 2 if name == "neuron" else 10
    torch.manual_seed(0)
    model = build_model(name, shape, num_classes)
    assert isinstance(model, nn.Sequential)
    out = model(torch.randn(2, *shape))
    assert out.shape == (2, num_classes) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["lenet", "cnn", "resnet18"])
def test_conv_models_backpropagate(name):
    torch.manual_seed(0)
    model = build_model(name, SHAPES["digits"], 10)
    nn.functional.cross_entropy(model(torch.randn(4, 1, 8, 8)), torch.arange(4)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_benchmark_cnn_is_exactly_the_measured_one():
    model = build_model("cnn", (3, 32, 32), 10)
    assert count_parameters(model) == 1_070_794
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes == {
        "0.weight": (32, 3, 3, 3),
        "0.bias": (32,),
        "3.weight": (64, 32, 3, 3),
        "3.bias": (64,),
        "7.weight": (256, 4096),
        "7.bias": (256,),
        "9.weight": (10, 256),
        "9.bias": (10,),
    }


def test_parameter_counts_on_cifar():
    counts = {
        name: count_parameters(build_model(name, (3, 32, 32), 10)) for name in ("lenet", "resnet18", "vgg16")
    }
    assert counts["lenet"] == 136_886  # convs 456 + 2,416; fc 1024*120+120, 120*84+84, 84*10+10
    assert counts["resnet18"] == 11_173_962  # the well-known CIFAR ResNet-18 figure
    assert 14_700_000 < counts["vgg16"] < 14_750_000
    assert count_parameters(build_model("lenet", (1, 28, 28), 10)) == 107_786


def test_cut_points_are_whole_layers():
    resnet = build_model("resnet18", (3, 32, 32), 10)
    kinds = [type(m).__name__ for m in resnet]
    assert kinds == ["Sequential"] + ["BasicBlock"] * 8 + ["AdaptiveAvgPool2d", "Flatten", "Linear"]
    vgg = build_model("vgg16", (3, 32, 32), 10)
    convs = [i for i, m in enumerate(vgg) if isinstance(m, nn.Sequential)]
    assert len(convs) == 13 and convs[7] == 10  # Lerat et al.'s cut after the 8th conv: before child 11
    alex = build_model("alexnet", (3, 32, 32), 10)
    alex_convs = [i for i, m in enumerate(alex) if isinstance(m, nn.Conv2d)]
    assert alex_convs[3] == 8 and isinstance(alex[9], nn.ReLU)  # 4th conv + ReLU end at child 9
    # Children line up for every input size, so a cut index means the same layers everywhere.
    for name in ("alexnet", "vgg16"):
        small, large = build_model(name, (1, 8, 8), 10), build_model(name, (3, 32, 32), 10)
        assert len(small) == len(large)


def test_staged_forward_equals_whole_forward():
    torch.manual_seed(0)
    model = build_model("resnet18", (3, 16, 16), 10).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.allclose(model[5:](model[:5](x)), model(x))
        block = BasicBlock(16, 32, stride=2)
        assert block(torch.zeros(2, 16, 8, 8)).shape == (2, 32, 4, 4)


@pytest.mark.parametrize("name", ["lenet", "cnn", "alexnet", "vgg16", "resnet18"])
def test_image_models_refuse_flat_input(name):
    with pytest.raises(UserError, match=f"model '{name}' needs images"):
        build_model(name, (1,), 2)


def test_lenet_refuses_too_small_images():
    with pytest.raises(UserError, match="at least 4x4"):
        build_model("lenet", (1, 2, 2), 10)


def test_unknown_model():
    with pytest.raises(UserError, match="unknown model 'gpt-2'"):
        build_model("gpt-2", (3, 32, 32), 10)
