"""Refinement loss: the expected loss left after temperature scaling fitted on the same data.

Berta et al. (2025, "Rethinking early stopping: refine, then calibrate") split a proper loss into
a calibration error, which a cheap re-calibration removes, and a refinement error, which it cannot.
The refinement error keeps falling for longer than the raw validation loss during training (the
raw loss turns up as the network grows over-confident, which temperature scaling undoes), so it is
the better early-stopping criterion. Here the cheap re-calibration is temperature scaling
(:class:`torchcal.TemperatureScaling`), fitted on the scores being scored.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchcal._tempered_moments import tempered_moments
from torchcal._validation import check_logits_and_labels
from torchcal.distributed import ProcessGroup, all_reduce_, validate_together
from torchcal.functional.scoring import PER_SAMPLE_SCORES

__all__ = ["refinement_loss"]


def refinement_loss(logits: Tensor, labels: Tensor, loss: str = "log", *, process_group: ProcessGroup | None = None) -> Tensor:
    """Mean ``loss`` (nats for ``"log"``) of ``softmax(logits / T)`` with ``T`` fitted by temperature
    scaling on these same ``logits: (N, K)`` and ``labels: (N,)``; a float64 scalar tensor.

    The calibration loss of temperature scaling is ``cross_entropy(logits, labels) - refinement``.
    The cost is a few passes over the logits: the temperature fit's (in the logits' precision, see
    :func:`torchcal.calibrators.temperature.fit_inverse_temperature`), and one in float64 for the loss.

    Args:
        loss: the proper scoring rule, ``"log"`` (cross-entropy) or ``"brier"``; the temperature
            minimises it and it is the loss reported.
        process_group: data-parallel computation over a ``torch.distributed`` group: every process
            passes its shard and all get the refinement loss of the union (only sums travel).

    Example:
        >>> import torch
        >>> from torchcal.functional import cross_entropy
        >>> _ = torch.manual_seed(0)
        >>> logits = 3 * torch.randn(2000, 4)
        >>> labels = torch.distributions.Categorical(logits=logits / 3).sample()
        >>> raw, refined = cross_entropy(logits, labels), refinement_loss(logits, labels)
        >>> bool(refined < raw), round(float(refined), 2)  # three times too confident: TS helps
        (True, 1.12)
    """
    def check() -> tuple[Tensor, Tensor]:
        if loss not in PER_SAMPLE_SCORES:
            raise ValueError(f"loss must be one of {sorted(PER_SAMPLE_SCORES)}, got {loss!r}.")
        return check_logits_and_labels(logits, labels)

    # every process of a group at once: none waits alone in the fit's collectives for one that refused
    logits, labels = validate_together(check, process_group, logits)
    from torchcal.calibrators.temperature import TemperatureScaling  # the calibrators import this package

    scaling = TemperatureScaling()
    scaling.fit(logits, labels, loss=loss, process_group=process_group)
    beta = 1 / scaling.temperature  # 0 for T = inf
    # The loss at the fitted temperature in float64, chunk by chunk (a float64 copy of all the
    # logits would be 400 MB at 50,000 x 1,000).
    total = tempered_moments(logits, labels, [beta], loss, dtype=torch.float64)[0, 0]
    totals = torch.stack([total, total.new_tensor(float(labels.shape[0]))])
    total, count = all_reduce_(totals, process_group)
    return total / count
