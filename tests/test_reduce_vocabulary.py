"""One vocabulary: every ``method=`` and ``allocation=`` of edgetorch.reduce takes the same words."""

from __future__ import annotations

import re

import pytest

import edgetorch.reduce
from edgetorch.reduce import ALLOCATIONS, METHODS, reduce_model, solve_allocation

WIDTHS = [3, 2, 2]
# J_l curves for WIDTHS: pruning indexes kept inputs 0..M_{l-1}, low-rank ranks 0..min(M_{l-1}, M_l).
CURVES = {"prune": [[0, 3, 1, 0], [0, 5, 0]], "lowrank": [[0, 3, 1], [0, 5, 0]]}


def curves(method):
    return CURVES["lowrank" if method == "lowrank" else "prune"]


def test_the_word_sets_and_no_second_spelling():
    assert ALLOCATIONS == ("optimal", "pso", "uniform")
    assert METHODS == ("prune", "prune-ls", "lowrank")
    assert not {"SOLVERS", "REDUCTIONS", "save_reduced", "load_reduced"} & set(dir(edgetorch.reduce))


@pytest.mark.parametrize("allocation", ALLOCATIONS)
def test_each_allocation_word_works_in_allocate_and_reduce_model(mlp_and_data, allocation):
    model, x = mlp_and_data
    assert solve_allocation(curves("prune"), WIDTHS, 0.3, "prune", allocation=allocation).solver == allocation
    assert solve_allocation(curves("prune"), WIDTHS, 0.3, "prune", allocation=allocation).theta
    assert reduce_model(model, 0.5, "prune", allocation=allocation, calibration=x).allocation.solver == allocation


@pytest.mark.parametrize("method", METHODS)
def test_each_method_word_works_in_allocate_and_reduce_model(mlp_and_data, method):
    model, x = mlp_and_data
    assert solve_allocation(curves(method), WIDTHS, 0.1, method=method).theta  # low-rank reaches at most 0.1 here
    result = reduce_model(model, 0.5, method, calibration=x)
    assert result.method == result.allocation.method == method


@pytest.mark.parametrize("word", ["exact", "greedy"])
def test_other_allocation_words_are_refused_with_the_accepted_ones(mlp_and_data, word):
    model, x = mlp_and_data
    message = re.escape(f"unknown allocation {word!r}; accepted: optimal, pso, uniform")
    with pytest.raises(ValueError, match=message):
        solve_allocation(curves("prune"), WIDTHS, 0.3, "prune", allocation=word).theta
    with pytest.raises(ValueError, match=message):
        reduce_model(model, 0.5, "prune", allocation=word, calibration=x)


def test_other_method_words_are_refused_with_the_accepted_ones(mlp_and_data):
    model, x = mlp_and_data
    message = re.escape("unknown method 'svd'; accepted: prune, prune-ls, lowrank")
    with pytest.raises(ValueError, match=message):
        solve_allocation(curves("prune"), WIDTHS, 0.3, "svd").theta
    with pytest.raises(ValueError, match=message):
        reduce_model(model, 0.5, "svd", calibration=x)


def test_the_folded_names_say_where_they_went():
    with pytest.raises(AttributeError, match=r"folded into reduce_model: use reduce_model\(\.\.\.\)\.model"):
        edgetorch.reduce.reduce  # noqa: B018
    with pytest.raises(AttributeError, match=r"solve_allocation\(\.\.\.\)\.theta"):
        edgetorch.reduce.allocate  # noqa: B018
