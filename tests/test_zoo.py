"""Zoo: model shapes, spec resolution, safe weight files, cached pretraining on digits."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn

from edgetorch.zoo import (
    MLP,
    BasicBlock,
    CheckpointError,
    PlainCNN,
    PretrainConfig,
    ZOO_MODELS,
    SmallResNet,
    build_model,
    checkpoint_paths,
    default_config,
    load_pretrained,
    load_weights,
    pretrain,
    pretrained,
    save_weights,
)
from edgetorch.weights import file_sha256

TINY_MLP = PretrainConfig("mlp", "digits", epochs=1, batch_size=64, train_limit=256)
TINY_CNN = PretrainConfig("cnn", "digits", epochs=1, batch_size=64, train_limit=128)
X28 = torch.rand(3, 1, 28, 28)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- models ----------------------------------------------------------------------------------


def test_cnn_shapes_and_segments():
    model = SmallResNet().eval()
    assert 100_000 <= n_params(model) <= 500_000
    assert model(X28).shape == (3, 10)
    assert isinstance(model.features, nn.Sequential) and len(model.features) >= 4
    # Running the sequence by hand is the whole forward: segment-wise tools can rely on it.
    torch.testing.assert_close(model.classifier(model.pool(model.features(X28))), model(X28))
    rgb = SmallResNet(num_classes=3, in_channels=3, widths=(8, 16), blocks_per_stage=(2, 1))
    assert rgb(torch.rand(2, 3, 32, 32)).shape == (2, 3)
    assert len(rgb.features) == 4  # stem + 2 + 1 blocks


def test_mlp_shapes():
    model = MLP(hidden=(64, 32, 16))
    assert isinstance(model, nn.Sequential)
    assert model(X28).shape == (3, 10)
    assert [m.out_features for m in model if isinstance(m, nn.Linear)] == [64, 32, 16, 10]
    assert MLP(num_classes=4, image_size=8)(torch.rand(2, 1, 8, 8)).shape == (2, 4)


def test_plain_cnn_is_a_sequential_chain():
    model = PlainCNN()
    assert isinstance(model, nn.Sequential) and not any(isinstance(m, BasicBlock) for m in model.modules())
    assert model(X28).shape == (3, 10)
    assert model[-3].in_features == 64 * 3 * 3  # 28 -> 14 -> 7 -> 3 after three poolings
    assert PlainCNN(num_classes=4, image_size=16)(torch.rand(2, 1, 16, 16)).shape == (2, 4)


@pytest.mark.parametrize(
    ("factory", "fragment"),
    [
        (lambda: PlainCNN(pool_after=(5,)), "pool_after must index"),
        (lambda: PlainCNN(image_size=4), "too small"),
        (lambda: SmallResNet(widths=()), "widths must be a non-empty"),
        (lambda: SmallResNet(widths=(8, 16), blocks_per_stage=(1,)), "blocks_per_stage has 1"),
        (lambda: SmallResNet(num_classes=0), "num_classes"),
        (lambda: MLP(hidden=(32, -1)), "hidden must be"),
    ],
)
def test_bad_model_arguments(factory, fragment):
    with pytest.raises(ValueError, match=fragment):
        factory()


# --- build_model -----------------------------------------------------------------------------


def test_build_zoo_and_torchvision():
    assert build_model("zoo:cnn", num_classes=5)(X28).shape == (3, 5)
    assert build_model("zoo:mlp", hidden=(32,))(X28).shape == (3, 10)
    tv = build_model("torchvision:resnet18", num_classes=7).eval()
    assert tv(torch.rand(1, 3, 32, 32)).shape == (1, 7)


def test_build_from_python_path(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        textwrap.dedent(
            """
            import torch.nn as nn

            def tiny(num_classes=2, width=4):
                return nn.Sequential(nn.Flatten(), nn.Linear(784, width), nn.Linear(width, num_classes))

            class Factory:
                @staticmethod
                def build(num_classes=3):
                    return nn.Linear(2, num_classes)

            def not_a_model(num_classes=2):
                return 42

            NOT_CALLABLE = 1
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert build_model("my_models:tiny", num_classes=6, width=8)(X28).shape == (3, 6)
    assert build_model("my_models:Factory.build").out_features == 3
    assert isinstance(build_model("torch.nn:Identity"), nn.Identity)
    with pytest.raises(TypeError, match="factory returned int, expected nn.Module"):
        build_model("my_models:not_a_model")
    with pytest.raises(ValueError, match="is not callable"):
        build_model("my_models:NOT_CALLABLE")
    with pytest.raises(ValueError, match="has no attribute 'Factory.missing'"):
        build_model("my_models:Factory.missing")


@pytest.mark.parametrize(
    ("spec", "kw", "fragment"),
    [
        ("cnn", {}, "malformed model spec 'cnn'; accepted forms"),
        ("zoo:", {}, "malformed model spec"),
        ("zoo:resnet", {}, "unknown zoo model 'resnet'; accepted: cnn, plaincnn, mlp"),
        ("zoo:cnn", {"depth": 3}, "zoo:cnn got bad arguments.*accepted: num_classes, in_channels"),
        ("torchvision:resnet19", {}, "classification model 'resnet19'; accepted: .*resnet18"),
        ("no_such_module_xyz:build", {}, "cannot import module 'no_such_module_xyz'"),
    ],
)
def test_build_model_errors(spec, kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        build_model(spec, **kw)


def test_named_torchvision_weights_are_not_downloaded():
    with pytest.raises(CheckpointError, match="IMAGENET1K_V1 does not exist.*never downloaded"):
        build_model("torchvision:resnet18", weights="IMAGENET1K_V1")


def test_torchvision_list_excludes_detection_models():
    with pytest.raises(ValueError) as info:
        build_model("torchvision:fasterrcnn_resnet50_fpn")
    assert "vit_b_16" in str(info.value) and "fasterrcnn" not in str(info.value).split("accepted:")[1]


# --- weight files ----------------------------------------------------------------------------


def test_weights_roundtrip_safetensors_and_torch(tmp_path):
    model = SmallResNet(widths=(8, 16)).eval()
    save_weights(model, tmp_path / "w.safetensors")
    torch.save(model.state_dict(), tmp_path / "w.pt")
    for name in ("w.safetensors", "w.pt"):
        other = build_model("zoo:cnn", widths=(8, 16), weights=tmp_path / name).eval()
        assert torch.equal(other(X28), model(X28))


def test_mismatched_weights_name_the_key(tmp_path):
    save_weights(SmallResNet(widths=(8, 16)), tmp_path / "w.safetensors")
    expected = r"shape mismatch: classifier\.weight \(file \[10, 16\], model \[5, 16\]\)"
    with pytest.raises(CheckpointError, match=expected):
        load_weights(SmallResNet(num_classes=5, widths=(8, 16)), tmp_path / "w.safetensors")
    with pytest.raises(CheckpointError, match=r"missing keys: .*features\.3"):
        load_weights(SmallResNet(widths=(8, 16, 32)), tmp_path / "w.safetensors")
    with pytest.raises(CheckpointError, match="unexpected keys"):
        load_weights(SmallResNet(widths=(8,)), tmp_path / "w.safetensors")


def test_unsafe_or_corrupt_weight_files_are_refused(tmp_path):
    model = MLP(hidden=(8,))
    torch.save(model, tmp_path / "whole_model.pt")  # a pickled module, not a state dict
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    (tmp_path / "w.ckpt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="a pickled edgetorch.zoo.models.MLP object, not a state dict"):
        load_weights(model, tmp_path / "whole_model.pt")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load_weights(model, tmp_path / "junk.safetensors")
    with pytest.raises(CheckpointError, match="unknown weight file suffix '.ckpt'"):
        load_weights(model, tmp_path / "w.ckpt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_weights(model, tmp_path / "absent.safetensors")
    with pytest.raises(CheckpointError, match="is a directory, not a file"):
        load_weights(model, tmp_path)


# --- pretraining -----------------------------------------------------------------------------


@pytest.mark.parametrize("config", [TINY_MLP, TINY_CNN], ids=["mlp", "cnn"])
def test_pretrain_caches_and_reloads_identically(tmp_path, config):
    rng_before = torch.random.get_rng_state()
    model = pretrained(config.model, "digits", config=config, cache=tmp_path)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # caller's RNG untouched
    weights_path, meta_path = checkpoint_paths(config, tmp_path)
    meta = json.loads(meta_path.read_text())
    assert meta["config"]["model"] == config.model and 0 <= meta["test_accuracy"] <= 1
    assert meta["torch_version"] == torch.__version__ and meta["train_samples"] == config.train_limit
    assert not model.training
    stamp = weights_path.stat().st_mtime_ns
    rng_before = torch.random.get_rng_state()
    again = pretrained(config.model, "digits", config=config, cache=tmp_path)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert weights_path.stat().st_mtime_ns == stamp  # loaded, not retrained
    x = torch.rand(4, 1, 28, 28)
    assert torch.equal(again(x), model(x))


def test_pretrain_is_reproducible_and_learns(tmp_path):
    config = PretrainConfig("mlp", "digits", epochs=3, batch_size=64, train_limit=640)
    a, meta = pretrain(config, cache=tmp_path / "a")
    b, _ = pretrain(config, cache=tmp_path / "b")
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    assert meta["test_accuracy"] > 0.7


def test_cache_location_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGETORCH_CACHE", str(tmp_path / "env-cache"))
    weights_path, meta_path = checkpoint_paths(TINY_MLP)
    assert weights_path.parent == tmp_path / "env-cache" / "zoo"
    assert weights_path.suffix == ".safetensors" and meta_path.suffix == ".json"
    assert checkpoint_paths(TINY_MLP)[0] != checkpoint_paths(
        PretrainConfig("mlp", "digits", epochs=2, batch_size=64, train_limit=256)
    )[0]


def test_cache_key_follows_architecture(tmp_path, monkeypatch):
    before = checkpoint_paths(TINY_MLP, tmp_path)[0]
    monkeypatch.setitem(ZOO_MODELS, "mlp", lambda **kw: MLP(hidden=(64,), **kw))
    assert checkpoint_paths(TINY_MLP, tmp_path)[0] != before


def test_corrupted_checkpoints_raise(tmp_path):
    pretrain(TINY_MLP, cache=tmp_path)
    weights_path, meta_path = checkpoint_paths(TINY_MLP, tmp_path)
    data = bytearray(weights_path.read_bytes())
    data[-3] ^= 0xFF  # flip bits in the tensor payload: only the checksum can notice
    weights_path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256 differs"):
        pretrained("mlp", "digits", config=TINY_MLP, cache=tmp_path)
    assert pretrained("mlp", "digits", config=TINY_MLP, cache=tmp_path, retrain=True) is not None
    meta = json.loads(meta_path.read_text())
    meta["config"]["epochs"] = 99
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="records config"):
        load_pretrained(TINY_MLP, tmp_path)
    meta_path.write_text("{trunc")
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        load_pretrained(TINY_MLP, tmp_path)
    meta_path.unlink()  # weights without their record count as absent
    assert load_pretrained(TINY_MLP, tmp_path) is None


def test_checkpoint_of_wrong_architecture_names_key(tmp_path):
    pretrain(TINY_MLP, cache=tmp_path)
    weights_path, meta_path = checkpoint_paths(TINY_MLP, tmp_path)
    save_weights(MLP(hidden=(256, 64)), weights_path)  # same keys, one layer narrower
    meta = json.loads(meta_path.read_text())
    meta["sha256"] = file_sha256(weights_path)
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"shape mismatch: 3\.weight"):
        load_pretrained(TINY_MLP, tmp_path)


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: PretrainConfig("vit", "digits"), "unknown zoo model 'vit'"),
        (lambda: PretrainConfig("mlp", "mnist"), "unknown dataset 'mnist'"),
        (lambda: PretrainConfig("mlp", "digits", epochs=0), "epochs must be a positive int"),
        (lambda: PretrainConfig("mlp", "digits", batch_size=64, train_limit=10), "train_limit must be"),
        (lambda: PretrainConfig("mlp", "digits", lr=0.0), "need lr > 0"),
        (lambda: default_config("rnn"), "no pretraining recipe for rnn/fashion-mnist"),
        (lambda: pretrained("cnn", "digits", config=TINY_MLP), "config is for mlp/digits"),
        (lambda: pretrain(TINY_MLP, data_root="/tmp"), "apply only to fashion-mnist"),
    ],
)
def test_bad_pretrain_arguments(make, fragment):
    with pytest.raises(ValueError, match=fragment):
        make()


def test_torchvision_models_with_auxiliary_heads_return_plain_logits_in_train_mode():
    model = build_model("torchvision:googlenet", num_classes=3).train()
    assert isinstance(model(torch.randn(2, 3, 64, 64)), torch.Tensor)
    kept = build_model("torchvision:googlenet", num_classes=3, aux_logits=True, init_weights=True).train()
    assert not isinstance(kept(torch.randn(2, 3, 64, 64)), torch.Tensor)  # the user's choice wins
