"""JSON files users pass or find in a run directory (`split plan --device/--server/--accuracy`, `split export
--trained`): any content gives the package's error (a ValueError) or a valid result, never a traceback."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict

import pytest
import torch
import torchvision
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgetorch import InputFileError
from edgetorch.split import inject_bottleneck
from edgetorch.split.plan import load_accuracy
from edgetorch.split.power import PROFILES, SERVERS, load_profile, load_server
from edgetorch.split.coded import fit_code_tables, save_code_tables
from edgetorch.split.student import RECORD_FORMAT, RECORD_NAME, RECORD_VERSION, TABLES_NAME, WEIGHTS_NAME, load_trained
from edgetorch.zoo import save_weights

JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)


def _paths(value, prefix=()):
    """Every path to a value inside nested dicts and lists."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*prefix, index))


def _mutated(valid: dict, data) -> object:
    """``valid`` with one value (or the whole) replaced by random JSON, or one key dropped."""
    paths = list(_paths(valid))
    path = data.draw(st.sampled_from(paths))
    if not path:
        return data.draw(JSON)
    value = copy.deepcopy(valid)
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and data.draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(JSON)
    return value


def _loads_or_refuses(loader, path) -> None:
    try:
        loader(str(path))
    except ValueError:  # the package's errors (InputFileError, CheckpointError) are ValueErrors
        pass


VALID = {
    "device": (load_profile, asdict(PROFILES["jetson-nano"])),
    "server": (load_server, {**asdict(SERVERS["quadro-p600"]), "measured": {
        "arch": "torchvision:resnet18", "resolution": 224, "split_point": "sp2", "full_s": 0.01,
        "tail_s": {"3": 0.004}}}),
    "accuracy": (load_accuracy, {"teacher": 0.9, "jpeg": 0.88, "split": {"3": 0.87, "12": 0.9}}),
}


@pytest.mark.parametrize("kind", VALID)
def test_the_valid_file_loads(tmp_path, kind):
    loader, valid = VALID[kind]
    (tmp_path / "f.json").write_text(json.dumps(valid))
    loader(str(tmp_path / "f.json"))


@pytest.mark.parametrize("kind", VALID)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_file_loads_or_is_refused_cleanly(tmp_path, kind, data):
    loader, valid = VALID[kind]
    (tmp_path / "f.json").write_text(json.dumps(_mutated(valid, data)))
    _loads_or_refuses(loader, tmp_path / "f.json")


@pytest.mark.parametrize("kind", VALID)
@pytest.mark.parametrize("content", ["[" * 100_000 + "]" * 100_000, "\xff", "", "{" + '"a":1,' * 10 + "}"],
                         ids=["deep", "latin-1", "empty", "trailing-comma"])
def test_malformed_json_is_the_packages_error(tmp_path, kind, content):
    loader, _ = VALID[kind]
    (tmp_path / "f.json").write_bytes(content.encode("latin-1"))
    with pytest.raises(InputFileError):
        loader(str(tmp_path / "f.json"))


@pytest.mark.parametrize("kind", VALID)
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path, kind):
    loader, _ = VALID[kind]
    os.mkfifo(tmp_path / "f.json")
    with pytest.raises(InputFileError, match="not a regular file"):
        loader(str(tmp_path / "f.json"))


@pytest.fixture(scope="module")
def trained_record(tmp_path_factory):
    """A `split train` directory's record and weights, made directly (no training)."""
    torch.manual_seed(0)
    student = inject_bottleneck(torchvision.models.resnet18(num_classes=3), 2, "sp2")
    root = tmp_path_factory.mktemp("trained")
    record = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "model": student.spec(), "resolution": 32,
              "preprocess": {"color": "rgb", "mean": [0.5], "std": [0.25]}, "class_names": ["a", "b", "c"],
              "weights": {"path": WEIGHTS_NAME, "sha256": save_weights(student, root / WEIGHTS_NAME)},
              "code_tables": {"path": TABLES_NAME, "sha256": save_code_tables(
                  fit_code_tables(torch.zeros(1, 2, 1, dtype=torch.uint8)), root / TABLES_NAME)}}
    return root, record


def test_the_valid_record_loads(trained_record, tmp_path):
    root, record = trained_record
    (root / RECORD_NAME).write_text(json.dumps(record))
    assert load_trained(root).class_names == ("a", "b", "c") and load_trained(root).code_tables.channels == 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_training_record_loads_or_is_refused_cleanly(trained_record, data):
    root, record = trained_record
    (root / RECORD_NAME).write_text(json.dumps(_mutated(record, data)))
    _loads_or_refuses(load_trained, root)


def test_a_record_asking_for_a_huge_model_is_refused_before_building_it(trained_record):
    """A 10**6-class resnet18 tail is 2 GB: the record's model is checked against the weights first."""
    root, record = trained_record
    huge = copy.deepcopy(record)
    huge["model"]["num_classes"] = 10**6
    (root / RECORD_NAME).write_text(json.dumps(huge))
    with pytest.raises(ValueError, match="describes a model of 2094498936 bytes of weights"):
        load_trained(root)
