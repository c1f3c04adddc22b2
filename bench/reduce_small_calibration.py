"""Small calibration sets: does prune-ls keep an honest J, and its budget, with fewer samples than units?

What it measures. The zoo MLP (784-256-128-10, pretrained on Fashion-MNIST and cached) is reduced
with prune-ls, exact allocation, alpha 0.5, from the first N training images, N in SAMPLES, twice:

* "shrunk": the library as it is: every covariance shrunk towards its diagonal with the
  Schaefer-Strimmer intensity lambda (``edgetorch.reduce.statistics.Moments``), for the curve
  and the least-squares refit alike;
* "lambda = 0": the same code with the intensity forced to 0, i.e. the plain sample covariance
  the library used before (what issue 13 measured: J reported 0, MACs far below budget).

Per point: the MAC ratio reduced / full (the budget is 0.5), test accuracy on all 10,000 test
images, the J the allocation reports (sum over layers of the in-sample J_l) and the same J_l
measured on the test images (``J held out``): for each layer, the inputs the refit predicts from
the kept ones with the calibration estimate (``x_hat = mu + R (x_S - mu_S)``) against the inputs
the full network really produces on the test set, ``J = lost / (total - lost)`` with ``lost`` the
held-out residual variance (eq. 14's ratio with conditional variances, as the curve defines it;
``inf`` where the refit's estimate is worse than the means). The per-layer columns give both as
the fraction of the layer input's variance lost, ``J / (1 + J)``.
An honest J is close to its held-out value; the lambda of each layer is listed too.

Outputs: docs/results/reduce_small_calibration.{json,md}. Run:
``.venv/bin/python bench/reduce_small_calibration.py`` (about a minute once the MLP is cached).
"""

from __future__ import annotations

import contextlib
import time
from unittest import mock

import numpy as np
import torch
from _common import table, write_results

from edgetorch.data import load_dataset
from edgetorch.reduce import ChainReducer, count_macs, statistics
from edgetorch.reduce.sequential import InputStatistics, prune_orders
from edgetorch.reduce.statistics import accumulate_inputs, kept_inputs
from edgetorch.zoo import default_config, evaluate_accuracy, load_pretrained, pretrain

NAME = "reduce_small_calibration"
SAMPLES = (50, 100, 200, 2000)
ALPHA = 0.5


def held_out_errors(model: torch.nn.Module, stats: InputStatistics, test: torch.Tensor,
                    kept: list[int]) -> list[float]:
    """Per layer, J_l of the kept inputs measured on ``test``, with the refit estimated from the calibration
    statistics ``stats`` (``inf`` where the estimate loses more than the inputs' whole variance: worse than
    their means)."""
    orders = prune_orders(stats, correlated=True)
    inputs: dict[int, list[torch.Tensor]] = {p: [] for p in range(len(stats.layers))}
    accumulate_inputs(model, test, 1000, {model[layer.index]: (lambda x, p=p: inputs[p].append(x.flatten(1)))
                                          for p, layer in enumerate(stats.layers)})
    errors = []
    for p, ((order, _), k) in enumerate(zip(orders, kept)):
        x = torch.cat(inputs[p]).double().numpy()
        units = x.shape[1]
        keep = np.sort(order[:k])
        # The refit of an identity layer is the estimate x_hat = R x_S + (mu - R mu_S) itself.
        mapping, shift = kept_inputs(np.eye(units)[:, :, None], np.zeros(units), stats.covariances[p],
                                     stats.means[p], keep, refit=True)
        residual = x - (x[:, keep] @ mapping[:, :, 0].T + shift)
        lost, total = residual.var(0).sum(), x.var(0).sum()
        errors.append(float(lost / (total - lost)) if lost < total else float("inf"))  # worse than the means
    return errors


def lost_fractions(errors: list[float]) -> str:
    """``J / (1 + J)`` per layer: the fraction of the layer input's variance lost (1 for ``inf``)."""
    return ", ".join(f"{(j / (1 + j) if np.isfinite(j) else 1.0):.3f}" for j in errors)


def main() -> None:
    torch.set_num_threads(1)
    config = default_config("mlp", "fashion-mnist")
    model, _ = load_pretrained(config) or pretrain(config)
    test = load_dataset("fashion-mnist", "test")
    train = load_dataset("fashion-mnist", "train", limit=max(SAMPLES)).tensors[0]
    full_macs = count_macs(model, test.tensors[0][:1])
    full_accuracy = evaluate_accuracy(model, test)
    rows, records = [], []
    for variant in ("lambda = 0", "shrunk"):
        patch = (mock.patch.object(statistics, "diagonal_shrinkage", lambda *a: 0.0) if variant == "lambda = 0"
                 else contextlib.nullcontext())
        with patch:
            for n in SAMPLES:
                calibration = train[:n]
                start = time.perf_counter()  # reduce_model's work: statistics, curves, solver, network
                reducer = ChainReducer(model, calibration)
                result = reducer.reduce(ALPHA, "prune-ls", "optimal")
                seconds = time.perf_counter() - start
                kept = result.allocation.theta
                lambdas = reducer.statistics.shrinkage
                held = held_out_errors(model, reducer.statistics, test.tensors[0], kept)
                ratio = count_macs(result.model, test.tensors[0][:1]) / full_macs
                accuracy = evaluate_accuracy(result.model, test)
                record = {"variant": variant, "samples": n, "mac_ratio": ratio, "accuracy": accuracy,
                          "kept": kept, "J": result.allocation.objective, "J_layers": [f.error for f in result.layers],
                          "J_held_out": sum(held), "J_held_out_layers": held, "lambda": lambdas, "seconds": seconds}
                records.append(record)
                rows.append([variant, n, f"{ratio:.3f}", f"{100 * accuracy:.1f}%", kept, f"{record['J']:.3g}",
                             f"{sum(held):.3g}", lost_fractions(record["J_layers"]), lost_fractions(held),
                             ", ".join(f"{v:.2f}" for v in lambdas)])
                print(rows[-1], flush=True)
    body = (
        f"Zoo MLP (784-256-128-10) on Fashion-MNIST, {100 * full_accuracy:.1f}% test accuracy unreduced; prune-ls, "
        f"exact allocation, alpha {ALPHA} (MAC budget ratio {1 - ALPHA}), calibration = the first N training "
        "images. 'lambda = 0' is the plain sample covariance (the library before shrinkage); 'shrunk' is the "
        "library now. J is what the allocation reports (sum of the layers' in-sample J_l); J held out is the "
        "same sum measured on the 10,000 test images with the refit estimated on the calibration images.\n\n"
        + table(["covariance", "N", "MAC ratio", "test accuracy", "kept inputs per layer", "J reported",
                 "J held out", "variance lost per layer, reported", "held out", "lambda per layer"], rows)
    )
    write_results(NAME, "prune-ls with small calibration sets: shrinkage keeps J honest", body,
                  {"alpha": ALPHA, "full_accuracy": full_accuracy, "full_macs": full_macs, "results": records})


if __name__ == "__main__":
    main()
