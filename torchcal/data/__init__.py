"""Data in and out of torchcal: file loaders, the bundled real example, synthetic posteriors.

Example:
    >>> from torchcal.data import EXAMPLE_PATH, load_scores
    >>> test = load_scores(EXAMPLE_PATH)                # ResNet-110 CIFAR-10 test logits
    >>> heldout = load_scores(EXAMPLE_PATH, split="val")
    >>> test.logits.shape, heldout.logits.shape, test.read_as
    (torch.Size([10000, 10]), torch.Size([5000, 10]), 'logits')
"""

from torchcal.data.loading import (
    EXAMPLE_PATH,
    PROBABILITY_FLOOR,
    Scores,
    binary_scores_to_logits,
    has_split,
    load_scores,
)
from torchcal.data.synthetic import (
    GaussianTask,
    class_priors,
    distort_likelihoods,
    ferrer_systems,
    gaussian_task,
    log_posteriors,
    mismatched_priors,
    scale_log_posteriors,
)

__all__ = [
    "EXAMPLE_PATH",
    "PROBABILITY_FLOOR",
    "GaussianTask",
    "Scores",
    "binary_scores_to_logits",
    "class_priors",
    "distort_likelihoods",
    "ferrer_systems",
    "gaussian_task",
    "has_split",
    "load_scores",
    "log_posteriors",
    "mismatched_priors",
    "scale_log_posteriors",
]
