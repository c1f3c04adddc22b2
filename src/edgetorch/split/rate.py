"""The rate term of rate-aware stage 2 (issue 27): train a student for fewer coded bytes.

A student trained as BottleFit trains it sends 8-bit codes spread over every value a channel
takes. Learned compression (Balle et al. 2017; Matsubara et al.'s Entropic Student, 2022) instead
adds the bits of the coded bottleneck to the loss, so the encoder learns to put its values on few,
frequent codes. Here:

* the bottleneck is quantised with fixed per-channel steps (:class:`~.coded.FixedSteps`, fitted
  once on the stage-1 student's training bottlenecks, then kept), the quantiser payload version 3
  uses: the tail trains on exactly the values the server decodes, with a straight-through gradient
  to the encoder (rounding passes the gradient unchanged);
* the rate is the bits those codes cost under the code distribution of the batch itself, per
  channel (what :func:`~.coded.fit_code_tables` counts over the training set for the real coder),
  smoothed by half a count per code. Its gradient comes from the uniform-noise relaxation of
  rounding (Balle et al.): each value plus noise in (-1/2, 1/2) step reads the log-probability
  between its two nearest codes, linearly interpolated, so the slope moves it toward the more
  frequent one. Task loss through rounded values and rate through noisy ones is the "mixed"
  quantisation of Minnen and Singh (2020).

The prior is the empirical code distribution, not a parametric density: the coder's tables are
counts, so the term estimates what the rANS coder will spend, and it has no parameters or state
(a resumed stage continues exactly). Bytes reported anywhere come from real payloads, never this
estimate.

Example:
    >>> from edgetorch.split.coded import FixedSteps
    >>> term = RateTerm(FixedSteps.fit(torch.rand(16, 3, 4, 4)))
    >>> rounded, bits = term(torch.rand(2, 3, 4, 4, requires_grad=True))
    >>> rounded.shape, bits.shape
    (torch.Size([2, 3, 4, 4]), torch.Size([]))
"""

from __future__ import annotations

import torch

from .coded import CODES, FixedSteps

#: counts added to every code of the batch's histogram: a code the batch never used costs a finite,
#: large number of bits (about log2 of twice the batch's values per channel)
SMOOTHING = 0.5


class RateTerm:
    """Rounds a bottleneck with fixed steps and estimates the bits its codes cost (module docstring).

    Args:
        steps: the fixed per-channel quantiser.
    """

    def __init__(self, steps: FixedSteps) -> None:
        self.steps = steps

    def __call__(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Round ``z`` and estimate its bits.

        Args:
            z: the head's output ``[N, *steps.sample_shape]``.

        Returns:
            ``(rounded, bits)``: ``z`` dequantised from its codes, with the gradient of ``z``
            (straight through), and the estimated bits per sample (a scalar with a gradient).
        """
        channels = self.steps.sample_shape[0]
        scale64, zero64 = self.steps.broadcast(z.device)
        # the codes as FixedSteps.quantize computes them (float64): the tail trains on what the
        # server decodes. A NaN (a diverging run) becomes code 0 here, so that the loss, not the
        # histogram's bincount, reports it (as TrainingDiverged).
        codes = torch.round(z.detach().double().nan_to_num(0.0) / scale64 + zero64).clamp(0, CODES - 1).float()
        scale, zero = scale64.float(), zero64.float()
        rounded = z + ((codes - zero) * scale - z).detach()
        continuous = z / scale + zero
        # the batch's code histogram per channel, as log2-probabilities [C, 256]
        channel = torch.arange(channels, device=z.device).view(scale.shape).expand_as(codes)
        keys = (channel * CODES + codes.long()).reshape(-1)
        # index_add_ into a known size, not bincount: on a GPU bincount reads the largest key back to
        # size its output, a host sync in every training step
        counts = torch.zeros(channels * CODES, device=z.device).index_add_(0, keys, torch.ones_like(keys, dtype=torch.float32))
        counts = counts.view(channels, CODES) + SMOOTHING
        log_p = (counts / counts.sum(dim=1, keepdim=True)).log2().reshape(-1)
        noisy = (continuous + torch.rand_like(continuous) - 0.5).clamp(0, CODES - 1)
        below = noisy.detach().nan_to_num(0.0).floor().clamp(max=CODES - 2)
        share = noisy - below  # in [0, 1]: the weight of the code above
        base = channel * CODES + below.long()
        bits = -((1 - share) * log_p[base] + share * log_p[base + 1])
        return rounded, bits.sum() / z.shape[0]
