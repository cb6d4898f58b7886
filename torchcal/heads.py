"""Calibration heads: a fitted calibrator attached to a trained network, as one ``nn.Module``.

:class:`CalibratedModel` maps the network's inputs to calibrated outputs. Its :meth:`~CalibratedModel.fit`
runs the frozen network once over a held-out loader, collects the scores on the network's device
(:func:`collect_scores`) and fits the calibrator on them; the network itself is never changed.

The network's output kind is declared with ``output``:

- ``"logits"`` or ``"log_probs"``: scores in the log domain (any unnormalised log-posteriors; the
  two are treated alike). The head returns calibrated log-posteriors, which are valid logits.
- ``"probs"``: posteriors. The head calibrates ``log(probs)`` and returns calibrated probabilities.

So the head returns the same kind of output as the network and is a drop-in replacement for it.
It saves and loads with ``state_dict``, compiles with ``torch.compile`` and exports with
``torch.export`` and ``torch.onnx.export(..., dynamo=True)`` (every calibrator, the step maps of
histogram binning and isotonic regression included).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from torchcal._validation import check_probs
from torchcal.calibrators.base import Calibrator

__all__ = ["CalibratedModel", "OutputKind", "attach", "calibrate_output", "collect_scores", "scores_from_outputs"]

OutputKind = Literal["logits", "log_probs", "probs"]
_OUTPUT_KINDS = get_args(OutputKind)

#: ``split_batch(batch) -> (args, labels)``: the network is called as ``model(*args)``.
SplitBatch = Callable[[Any], tuple[Sequence[Any], Tensor]]


def _check_output_kind(output: str) -> None:
    if output not in _OUTPUT_KINDS:
        raise ValueError(f"output must be one of {_OUTPUT_KINDS} (what the network returns), got {output!r}.")


def _to_scores(output: Tensor, kind: str) -> Tensor:
    """Network output (N, K) -> scores in the log domain, the calibrators' input."""
    if kind == "probs":
        # A probability of exactly 0 would give log(0) = -inf, which no calibrator accepts.
        return torch.log(output.clamp_min(torch.finfo(output.dtype).tiny))
    return output


def calibrate_output(calibrator: Calibrator, output: Tensor, kind: OutputKind = "logits") -> Tensor:
    """Calibrate a network output (N, K) of the given kind; returns the same kind (N, K).

    ``"logits"`` and ``"log_probs"`` give calibrated log-posteriors, ``"probs"`` calibrated
    probabilities. Pure tensor code without value checks, so it traces for export.
    """
    log_posteriors = calibrator(_to_scores(output, kind))
    return log_posteriors.exp() if kind == "probs" else log_posteriors


def _default_split(batch: Any) -> tuple[Sequence[Any], Tensor]:
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[:-1], batch[-1]
    raise TypeError(
        f"cannot split a batch of type {type(batch).__name__} into inputs and labels: the default "
        f"expects (inputs..., labels) tuples as from a TensorDataset. Pass "
        f"split_batch=lambda batch: ((batch['x'],), batch['y']) (network arguments, labels)."
    )


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _device_of(model: nn.Module) -> torch.device:
    tensor = next(model.parameters(), None)
    if tensor is None:
        tensor = next(model.buffers(), None)
    return torch.device("cpu") if tensor is None else tensor.device


def collect_scores(
    model: nn.Module,
    dataloader: Iterable[Any],
    *,
    output: OutputKind = "logits",
    split_batch: SplitBatch | None = None,
) -> tuple[Tensor, Tensor]:
    """Run ``model`` once over ``dataloader`` in eval mode without gradients.

    Batches are moved to the device of the model's parameters, where the results stay. The
    training flag of every submodule is restored afterwards.

    Args:
        model: the network; ``model(*args)`` returns outputs (B, K) of kind ``output``.
        dataloader: yields ``(inputs..., labels)`` batches, or anything ``split_batch`` splits.
        output: what the network returns (see the module docs).
        split_batch: ``batch -> (args, labels)``; the default takes the last element of a tuple
            batch as the labels and the others as the network's arguments.

    Returns:
        ``(scores, labels)``: scores (N, K) in the log domain (``log(probs)`` for ``"probs"``)
        and labels (N,).
    """
    _check_output_kind(output)
    split = split_batch or _default_split
    device = _device_of(model)
    modes = [(m, m.training) for m in model.modules()]
    outputs, labels = [], []
    model.eval()
    try:
        with torch.no_grad():
            for batch in dataloader:
                args, y = split(batch)
                outputs.append(model(*_to_device(tuple(args), device)))
                labels.append(torch.as_tensor(y).to(device))
    finally:
        for module, mode in modes:  # pre-order: parents first, so children end in their own mode
            module.train(mode)
    if not outputs:
        raise ValueError("the dataloader yielded no batches: the calibrator needs held-out samples.")
    return scores_from_outputs(torch.cat(outputs), output), torch.cat(labels)


def scores_from_outputs(outputs: Tensor, output: OutputKind = "logits") -> Tensor:
    """Scores in the log domain (N, K) from network outputs (N, K) of kind ``output``, checked.

    Probabilities must be rows in [0, 1] summing to one (else ``ValueError``); log-domain outputs
    that look like probabilities warn, since the kind was probably mis-declared.
    """
    _check_output_kind(output)
    if output == "probs":
        check_probs(outputs, "network outputs")
    elif outputs.ndim == 2 and bool(((outputs >= 0) & (outputs <= 1)).all()) and torch.allclose(
        outputs.sum(dim=1, dtype=torch.float64), torch.ones((), dtype=torch.float64), atol=1e-4
    ):
        warnings.warn(
            f"the network outputs look like probabilities (rows in [0, 1] summing to one) but "
            f"output={output!r}; pass output='probs' if they are.",
            stacklevel=3,
        )
    return _to_scores(outputs, output)


class CalibratedModel(nn.Module):
    """A network followed by a calibration head: ``calibrator(model(x))``, as one module.

    Args:
        model: the trained network; it is used as is and never modified by :meth:`fit`.
        calibrator: any torchcal calibrator, fitted or not (fit it with :meth:`fit`).
        output: what the network returns: ``"logits"`` (default), ``"log_probs"`` or ``"probs"``.
            The head returns the same kind, calibrated (see the module docs).

    ``forward(x, *args, **kwargs)`` calls ``model(x, *args, **kwargs)`` and calibrates its (N, K) output.
    The state dict holds the network's weights under ``model.`` and the fitted head under
    ``calibrator.``; it loads into a fresh ``CalibratedModel(network, UnfittedCalibrator())``.
    Change the network's precision with ``head.model.half()``: ``head.half()`` would also round
    the head's float64 parameters (the head computes in the network's output dtype anyway).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from torchcal import TemperatureScaling
        >>> from torchcal.heads import CalibratedModel
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(2000, 3)
        >>> y = torch.distributions.Categorical(logits=x).sample()
        >>> net = nn.Linear(3, 3, bias=False)
        >>> net.weight.data = 4 * torch.eye(3)  # four times too confident
        >>> loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=500)
        >>> head = CalibratedModel(net, TemperatureScaling()).fit(loader)
        >>> round(head.calibrator.temperature, 1), head(x[:5]).shape
        (3.9, torch.Size([5, 3]))
    """

    def __init__(self, model: nn.Module, calibrator: Calibrator, output: OutputKind = "logits") -> None:
        super().__init__()
        if not isinstance(calibrator, Calibrator):
            raise TypeError(
                f"calibrator must be a torchcal calibrator such as torchcal.TemperatureScaling(), got "
                f"{type(calibrator).__name__}."
            )
        _check_output_kind(output)
        self.model = model
        self.calibrator = calibrator
        self.output = output

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Calibrated outputs (N, K) of ``model(x, *args, **kwargs)``.

        ``x`` is named (rather than folded into ``*args``) so that ``torch.export`` takes
        ``dynamic_shapes=({0: batch},)`` as for the bare network.
        """
        if not self.calibrator.is_fitted:
            raise RuntimeError(
                f"the calibration head ({type(self.calibrator).__name__}) is not fitted yet: call "
                f".fit(heldout_loader) first, or load a fitted state_dict."
            )
        return calibrate_output(self.calibrator, self.model(x, *args, **kwargs), self.output)

    def fit(self, dataloader: Iterable[Any], *, split_batch: SplitBatch | None = None, **fit_options: Any) -> CalibratedModel:
        """Fit the head on the network's outputs over a held-out ``dataloader``; returns ``self``.

        Args:
            dataloader, split_batch: as in :func:`collect_scores`.
            **fit_options: passed to the calibrator's ``fit`` (``loss``, ``priors``, ``max_iter``).
        """
        scores, labels = collect_scores(self.model, dataloader, output=self.output, split_batch=split_batch)
        self.calibrator.fit(scores, labels, **fit_options)
        return self

    def extra_repr(self) -> str:
        return f"output={self.output!r}"


def attach(
    model: nn.Module,
    calibrator: Calibrator,
    dataloader: Iterable[Any] | None = None,
    *,
    output: OutputKind = "logits",
    split_batch: SplitBatch | None = None,
    **fit_options: Any,
) -> CalibratedModel:
    """``CalibratedModel(model, calibrator, output)``, fitted on ``dataloader`` when one is given.

    The one-line form: ``calibrated = torchcal.attach(net, torchcal.TemperatureScaling(), val_loader)``.
    """
    head = CalibratedModel(model, calibrator, output)
    return head if dataloader is None else head.fit(dataloader, split_batch=split_batch, **fit_options)
