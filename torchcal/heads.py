"""Calibration heads: a fitted calibrator attached to a trained network, as one ``nn.Module``.

:class:`CalibratedModel` maps the network's inputs to calibrated outputs. Its :meth:`~CalibratedModel.fit`
runs the frozen network once over a held-out loader, collects the scores on the network's device
(:func:`collect_scores`) and fits the calibrator on them; the network itself is never changed.

The network's output kind is declared with ``output``:

- ``"logits"`` or ``"log_probs"``: scores in the log domain (any unnormalised log-posteriors; the
  two are treated alike). The head returns calibrated log-posteriors, which are valid logits.
- ``"probs"``: posteriors. The head calibrates ``log(probs)`` and returns calibrated probabilities.

So the head returns the same kind of output as the network and is a drop-in replacement for it.
A network whose output is a tuple or dict (e.g. ``(logits, features)``) names where its logits are
with ``logits_key`` (an index or a key); only that element is calibrated, the rest pass through.

It saves and loads with ``state_dict``, compiles with ``torch.compile`` and exports with
``torch.export``, ``torch.onnx.export`` (``dynamo=True``, and the legacy ``dynamo=False``) and
``torch.jit.trace`` (every calibrator, the step maps of histogram binning, isotonic regression and
Venn–Abers included; a calibrator exports the same way alone or inside any other module). The
``dynamo=True`` export of pairwise Venn–Abers (``VennAbersCalibration(multiclass="pairwise")``) is
slow for many classes, though: its graph holds two searches per pair of classes and fold, unrolled,
and the exporter's graph optimiser (onnxscript) takes the time, growing quickly with K (measured on
one CPU thread with torch 2.13: 14 s at K = 4, 48 s at K = 6, minutes at K = 10; with
``optimize=False`` 8 s, 13 s and 34 s; with ``dynamo=False`` under a second at K = 6, 2 s at
K = 10, and the same outputs). Export it with ``dynamo=False`` or ``optimize=False`` for large K.
The one-vs-rest step maps grow the same way, more slowly: histogram binning and isotonic
regression hold one search per class (histogram binning took 6 s at K = 10, 36 s at K = 40 and
more than 3 minutes at K = 100; with ``optimize=False`` 15 s at K = 40, 31 s at K = 100), and
one-vs-rest Venn–Abers two per class and fold (14 s at K = 4, 71 s at K = 10 and, with
``folds=3``, 14 minutes; with ``optimize=False`` 6 s at K = 4): export it, too, with
``dynamo=False`` or ``optimize=False`` (review helpers' measurements, one CPU thread). Another
runtime (ONNX Runtime) may round the network's own output differently in its last float32 bit;
the step maps are discontinuous, so an input that sits exactly on a step moves to the
neighbouring one there. That input is rare for logits. With ``output="probs"`` it is common on a
saturated network: probabilities below the floor of :func:`torchcal._validation.floored_log` all
become the same score, and a step can sit exactly on that score. (Venn–Abers pools scores within
16 float64 ulps of a calibration score, which covers float64 round-off, not float32.) A float16
network is another matter: ONNX Runtime on the CPU computes its layers in float32 and does not
round their output to float16, so every head's output there differs from PyTorch's by float16's
resolution (1e-3 to 1e-2 in log-posteriors; a step map's up to 0.3 where a score crosses a step;
a review helper's measurements, ONNX Runtime 1.32): compare ONNX output against the network run
in float32, or export the network in float32. A compiled, exported or traced head, or one
under ``torch.func.vmap``, does not check its input's values as the eager head does (refusing
NaN and infinite scores); there a row with a NaN score comes out NaN, whatever the map (a step
map's look-up had put it on a confident step), and one with an infinite score as the map's limit
(a certain class, or NaN). A Lightning
checkpoint saved with :class:`torchcal.lightning.CalibrationCallback` holds the head under
:data:`CHECKPOINT_KEY` (one per callback); :meth:`CalibratedModel.from_checkpoint` loads it
without Lightning.
"""

from __future__ import annotations

import copy
import importlib
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from torchcal._validation import check_probs, floored_log, looks_like_probs
from torchcal.calibrators.base import Calibrator, check_calibrator, values_readable

__all__ = [
    "CHECKPOINT_KEY",
    "CalibratedModel",
    "LogitsKey",
    "OutputKind",
    "attach",
    "calibrate_output",
    "collect_scores",
    "head_checkpoint",
    "replace_logits",
    "scores_from_outputs",
    "select_logits",
]

OutputKind = Literal["logits", "log_probs", "probs"]
_OUTPUT_KINDS = get_args(OutputKind)

#: Where the logits are in a structured output: a dict key, a tuple/list index, or ``None``.
LogitsKey = str | int | None

#: Top-level key of a Lightning checkpoint that holds the calibration heads (see :func:`head_checkpoint`).
CHECKPOINT_KEY = "torchcal_calibration_head"

#: ``split_batch(batch) -> (args, labels)``: the network is called as ``model(*args)``.
SplitBatch = Callable[[Any], tuple[Sequence[Any], Tensor]]


def _check_output_kind(output: str, name: str = "output") -> None:
    if output not in _OUTPUT_KINDS:
        raise ValueError(f"{name} must be one of {_OUTPUT_KINDS} (what the network returns), got {output!r}.")


def _to_scores(output: Tensor, kind: str) -> Tensor:
    """Network output (N, K) -> scores in the log domain, the calibrators' input."""
    if kind == "probs":
        # A probability of exactly 0 would give log(0) = -inf, which no calibrator accepts.
        return floored_log(output)
    return output


def calibrate_output(calibrator: Calibrator, output: Tensor, kind: OutputKind = "logits") -> Tensor:
    """Calibrate a network output (N, K) of the given kind; returns the same kind (N, K).

    ``"logits"`` and ``"log_probs"`` give calibrated log-posteriors, ``"probs"`` calibrated
    probabilities. Pure tensor code without checks of the values (only of ``kind``, a string), so
    it traces for export.
    """
    _check_output_kind(kind, "kind")
    log_posteriors = calibrator(_to_scores(output, kind))
    return log_posteriors.exp() if kind == "probs" else log_posteriors


def select_logits(output: Any, key: LogitsKey = None) -> Tensor:
    """The logits tensor in a network's ``output``: the output itself when it is a tensor, else
    ``output[key]`` of a dict, tuple or list (e.g. ``key=0`` for ``(logits, features)``).

    Example:
        >>> import torch
        >>> logits, features = torch.zeros(2, 3), torch.ones(2, 8)
        >>> select_logits((logits, features), 0) is logits, select_logits(logits, "logits") is logits
        (True, True)
    """
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(key, str) and key in output:
        return output[key]
    if isinstance(output, (tuple, list)) and isinstance(key, int) and -len(output) <= key < len(output):
        return output[key]
    raise TypeError(
        f"cannot find the logits in an output of type {type(output).__name__} with logits_key={key!r}: "
        f"name their place, e.g. logits_key=0 for (logits, features) tuples or logits_key='logits' "
        f"for dicts."
    )


def replace_logits(output: Any, key: LogitsKey, logits: Tensor) -> Any:
    """``output`` with the tensor at ``key`` (see :func:`select_logits`) replaced by ``logits``;
    the other elements are passed through unchanged (a new container of the same type, e.g. an
    ``OrderedDict`` or a Hugging Face ``ModelOutput``; the input is not modified)."""
    if isinstance(output, Tensor):
        return logits
    select_logits(output, key)  # same checks and message
    if isinstance(output, Mapping):
        return _with_items(output, {key: logits})
    assert isinstance(key, int)
    items = list(output)
    items[key] = logits
    return _same_sequence(output, items)


def _with_items(output: Mapping[Any, Any], items: Mapping[Any, Any]) -> Mapping[Any, Any]:
    """A shallow copy of ``output`` of its own type (attribute access of ``ModelOutput`` and the
    like included) with ``items`` set; a plain dict for immutable mappings and types that cannot
    be copied without arguments."""
    if type(output) is not dict and isinstance(output, MutableMapping):
        try:
            copied = copy.copy(output)
        except TypeError:  # e.g. an OrderedDict subclass whose __init__ requires arguments
            pass
        else:
            for key, value in items.items():  # (item by item: transformers' ModelOutput refuses update())
                copied[key] = value
            return copied
    return {**output, **items}


def _default_split(batch: Any) -> tuple[Sequence[Any], Tensor]:
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[:-1], batch[-1]
    raise TypeError(
        f"cannot split a batch of type {type(batch).__name__} into inputs and labels: the default "
        f"expects (inputs..., labels) tuples as from a TensorDataset. Pass "
        f"split_batch=lambda batch: ((batch['x'],), batch['y']) (network arguments, labels)."
    )


def _to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it moved to ``device``, containers rebuilt as their own types
    (namedtuples, ``UserDict``s such as Hugging Face's ``BatchEncoding``: a mapping that is no dict
    had stayed on the CPU)."""
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return _same_sequence(value, [_to_device(v, device) for v in value])
    if isinstance(value, Mapping):
        moved = {k: _to_device(v, device) for k, v in value.items()}
        return moved if type(value) is dict else _with_items(value, moved)
    return value


def _same_sequence(value: tuple | list, items: list[Any]) -> Any:
    """``items`` in a sequence of ``value``'s type: a namedtuple by its fields, other tuple types
    (``torch.return_types``) and lists from the list, a plain tuple where the type takes no list."""
    kind: Any = type(value)
    if hasattr(value, "_fields"):
        return kind._make(items)
    try:
        return kind(items)
    except TypeError:
        return tuple(items)


def _device_of(model: nn.Module) -> torch.device:
    tensor: Tensor | None = next(model.parameters(), None)
    if tensor is None:
        tensor = next(model.buffers(), None)
    return torch.device("cpu") if tensor is None else tensor.device


def collect_scores(
    model: nn.Module,
    dataloader: Iterable[Any],
    *,
    output: OutputKind = "logits",
    split_batch: SplitBatch | None = None,
    logits_key: LogitsKey = None,
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
        logits_key: where the logits are in a structured output (see :func:`select_logits`).

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
            for index, batch in enumerate(dataloader):
                args, y = split(batch)
                if not isinstance(args, (tuple, list)):  # (a tensor would be split into its rows)
                    raise TypeError(f"split_batch must return (arguments, labels) with the network's arguments as a tuple, "
                                    f"e.g. ((x,), y); got arguments of type {type(args).__name__}.")
                outputs.append(select_logits(model(*_to_device(tuple(args), device)), logits_key))
                labels.append(torch.as_tensor(y).to(device))
                rows, count = (len(outputs[-1]) if outputs[-1].ndim else 1), (len(labels[-1]) if labels[-1].ndim else 1)
                if rows != count:
                    raise ValueError(
                        f"batch {index}: the model returned {rows} rows of outputs but the batch has {count} "
                        f"labels; they must describe the same samples (check split_batch and logits_key)."
                    )
                if outputs[-1].shape[1:] != outputs[0].shape[1:]:
                    raise ValueError(
                        f"batch {index}: the model returned outputs of shape {tuple(outputs[-1].shape)} but those of "
                        f"batch 0 had shape {tuple(outputs[0].shape)}; every batch must score the same K classes "
                        f"(check logits_key)."
                    )
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
    elif outputs.ndim == 2 and outputs.numel() > 0 and looks_like_probs(outputs):
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
        logits_key: where the logits are when the network returns a tuple or dict (an index or a
            key, see :func:`select_logits`); the head returns the same structure with them calibrated.

    ``forward(x, *args, **kwargs)`` calls ``model(x, *args, **kwargs)`` and calibrates its (N, K) output.
    The state dict holds the network's weights under ``model.`` and the fitted head under
    ``calibrator.``; it loads into a fresh ``CalibratedModel(network, UnfittedCalibrator())``.
    ``head.half()`` (or Lightning's ``"16-true"`` / ``"bf16-true"``) converts the network and leaves
    the calibrator's fitted tensors in float64 (it computes in the network's output dtype, float32
    for half precision, and returns that dtype).

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

    def __init__(
        self, model: nn.Module, calibrator: Calibrator, output: OutputKind = "logits", logits_key: LogitsKey = None
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be the network (a torch.nn.Module) whose outputs are calibrated, got {type(model).__name__}.")
        check_calibrator(calibrator)
        _check_output_kind(output)
        self.model = model
        self.calibrator = calibrator
        self.output = output
        self.logits_key = logits_key

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """Calibrated outputs (N, K) of ``model(x, *args, **kwargs)`` (in the same structure).

        ``x`` is named (rather than folded into ``*args``) so that ``torch.export`` takes
        ``dynamic_shapes=({0: batch},)`` as for the bare network.
        """
        if not self.calibrator.is_fitted:
            raise RuntimeError(
                f"the calibration head ({type(self.calibrator).__name__}) is not fitted yet: call "
                f".fit(heldout_loader) first, or load a fitted state_dict."
            )
        output = self.model(x, *args, **kwargs)
        scores = select_logits(output, self.logits_key)
        # (the calibrator checks log-domain outputs itself; an empty batch gives an empty batch)
        if self.output == "probs" and values_readable(scores) and scores.shape[0]:
            check_probs(scores, "network outputs")
        calibrated = calibrate_output(self.calibrator, scores, self.output)
        return replace_logits(output, self.logits_key, calibrated)

    def fit(self, dataloader: Iterable[Any], *, split_batch: SplitBatch | None = None, **fit_options: Any) -> CalibratedModel:
        """Fit the head on the network's outputs over a held-out ``dataloader``; returns ``self``.

        Args:
            dataloader, split_batch: as in :func:`collect_scores`.
            **fit_options: passed to the calibrator's ``fit`` (``loss``, ``priors``, ``max_iter``).
        """
        scores, labels = collect_scores(
            self.model, dataloader, output=self.output, split_batch=split_batch, logits_key=self.logits_key
        )
        self.calibrator.fit(scores, labels, **fit_options)
        return self

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        model: nn.Module,
        calibrator: Calibrator | None = None,
        *,
        prefix: str | None = None,
        load_weights: bool = True,
        map_location: str | torch.device | None = "cpu",
        weights_only: bool = True,
    ) -> CalibratedModel:
        """The calibrated network stored in a Lightning checkpoint, without a ``Trainer``.

        The checkpoint must have been saved with :class:`torchcal.lightning.CalibrationCallback`
        (the heads are under :data:`CHECKPOINT_KEY`, one per callback). Returns the head in eval mode.

        Args:
            path: the ``.ckpt`` file.
            model: the network, e.g. a fresh instance of the LightningModule that was trained.
            calibrator: an unfitted calibrator of the stored class, for one built with non-default
                arguments; by default the stored class is built with its defaults.
            prefix: the ``prefix`` of the callback whose head to load, for checkpoints of trainers
                with several CalibrationCallbacks (``calibrator`` also tells heads of different
                classes apart).
            load_weights: load the checkpoint's ``state_dict`` (the LightningModule's weights) into
                ``model``; ``False`` keeps ``model``'s own weights.
            map_location: as in ``torch.load``.
            weights_only: as in ``torch.load``: ``False`` for a checkpoint that pickles other
                objects (e.g. hyperparameters holding a ``pathlib.Path``), of a source you trust.
        """
        checkpoint = torch.load(path, map_location=map_location, weights_only=weights_only)
        heads = _stored_heads(checkpoint)
        if not heads:
            raise KeyError(
                f"{os.fspath(path)} holds no calibration head (no {CHECKPOINT_KEY!r} entry): save it from a "
                f"Trainer with torchcal.lightning.CalibrationCallback, after a validation epoch has fitted it "
                f"(earlier torchcal versions left it out of weights-only checkpoints, ModelCheckpoint(save_weights_only=True))."
            )
        entry = _select_head(heads, os.fspath(path), prefix, calibrator)
        if calibrator is None:
            calibrator = _calibrator_class(entry["calibrator"])()
        elif _class_path(calibrator) != entry["calibrator"]:
            raise TypeError(f"the checkpoint holds a {entry['calibrator']} head, not a {type(calibrator).__name__}.")
        _load_head_state(
            calibrator,
            entry,
            f"pass calibrator= an unfitted {type(calibrator).__name__} built with the same options as the one that was "
            f"fitted (the checkpoint stores its state, not its arguments)",
        )
        if load_weights:
            try:
                model.load_state_dict(checkpoint["state_dict"])
            except RuntimeError as error:
                stored, own = list(checkpoint["state_dict"]), list(model.state_dict())
                raise ValueError(
                    f"the weights in {os.fspath(path)} (the trained LightningModule's, e.g. {stored[:2]}) do not fit the "
                    f"{type(model).__name__} passed (e.g. {own[:2]}): pass a fresh instance of that LightningModule, or "
                    f"load_weights=False with a network that already holds its weights."
                ) from error
        return cls(model, calibrator, entry["output"], entry["logits_key"]).eval()

    def extra_repr(self) -> str:
        return f"output={self.output!r}" + ("" if self.logits_key is None else f", logits_key={self.logits_key!r}")


def head_checkpoint(calibrator: Calibrator, output: OutputKind = "logits", logits_key: LogitsKey = None) -> dict[str, Any]:
    """A checkpoint entry from which :meth:`CalibratedModel.from_checkpoint` rebuilds a head: the
    calibrator's class and ``state_dict``, the output kind and ``logits_key``; plain types and
    tensors only, so it loads with ``torch.load(..., weights_only=True)``. Under
    :data:`CHECKPOINT_KEY` goes either one entry or, as the Lightning callback writes them, a dict
    of entries by the callbacks' ``state_key``, each with the callback's ``prefix`` added."""
    if not calibrator.is_fitted:
        raise RuntimeError(
            f"this {type(calibrator).__name__} is not fitted: a checkpoint of it could not rebuild a head; "
            f"call .fit(logits, labels) on held-out data first."
        )
    _check_output_kind(output)
    return {
        "calibrator": _class_path(calibrator),
        "state_dict": calibrator.state_dict(),
        "output": output,
        "logits_key": logits_key,
    }


def _stored_heads(checkpoint: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The heads in a checkpoint, by the ``state_key`` of the CalibrationCallback that saved each.

    A single entry under :data:`CHECKPOINT_KEY` (written by hand with :func:`head_checkpoint`, or
    by torchcal versions that kept one head per checkpoint) comes back under the key ``""``.
    """
    stored = checkpoint.get(CHECKPOINT_KEY)
    if stored is None:
        return {}
    if "calibrator" in stored:  # one entry; state keys are "CalibrationCallback{...}"
        return {"": stored}
    return dict(stored)


def _select_head(heads: Mapping[str, dict[str, Any]], path: str, prefix: str | None, calibrator: Calibrator | None) -> dict[str, Any]:
    """The one head of ``heads`` with the callback prefix ``prefix`` (any if ``None``); among
    several, the one of ``calibrator``'s class."""
    matching = [entry for entry in heads.values() if prefix is None or entry.get("prefix") == prefix]
    if calibrator is not None and len(matching) > 1:
        matching = [entry for entry in matching if entry["calibrator"] == _class_path(calibrator)]
    if len(matching) == 1:
        return matching[0]
    found = ", ".join(f"{entry['calibrator'].rpartition('.')[2]} (prefix={entry.get('prefix')!r})" for entry in heads.values())
    if not matching:
        raise ValueError(f"{path} holds no head of a callback with prefix={prefix!r}; it holds {found}.")
    raise ValueError(
        f"{path} holds the heads of several CalibrationCallbacks: {found}. Choose one with prefix= "
        f"(and calibrator=, an unfitted instance of its class, where prefixes repeat)."
    )


def _load_head_state(calibrator: Calibrator, entry: Mapping[str, Any], remedy: str) -> None:
    """Load a stored head's state into ``calibrator``; a state its options cannot take raises
    with ``remedy`` rather than a bare key list."""
    described = repr(calibrator)  # its options, before the failed load changes it
    try:
        calibrator.load_state_dict(entry["state_dict"])
    except (RuntimeError, ValueError) as error:
        details = " ".join(str(error).split()).rstrip(".")
        raise type(error)(f"the stored head does not fit {described}, built with other options ({details}): {remedy}.") from error


def _class_path(calibrator: Calibrator) -> str:
    return f"{type(calibrator).__module__}.{type(calibrator).__qualname__}"


def _calibrator_class(name: str) -> type[Calibrator]:
    module, _, qualname = name.rpartition(".")
    cls = getattr(importlib.import_module(module), qualname, None) if module.startswith("torchcal.") else None
    if not (isinstance(cls, type) and issubclass(cls, Calibrator)):
        raise TypeError(f"the checkpoint names {name!r}, which is not a torchcal calibrator class.")
    return cls


def attach(
    model: nn.Module,
    calibrator: Calibrator,
    dataloader: Iterable[Any] | None = None,
    *,
    output: OutputKind = "logits",
    logits_key: LogitsKey = None,
    split_batch: SplitBatch | None = None,
    **fit_options: Any,
) -> CalibratedModel:
    """``CalibratedModel(model, calibrator, output)``, fitted on ``dataloader`` when one is given,
    ready for deployment: in eval mode, with every parameter (the network's, which are shared with
    ``model``, and the head's) frozen (``requires_grad=False``). Call ``.train()`` and
    ``.requires_grad_(True)`` on it to fine-tune (through a parametric calibrator: the step maps,
    histogram binning, isotonic regression and Venn-Abers, pass no gradient).

    The one-line form: ``calibrated = torchcal.attach(net, torchcal.TemperatureScaling(), val_loader)``.

    Example:
        >>> import torch, torchcal
        >>> x = torch.randn(300, 3)
        >>> loader = [(x, torch.distributions.Categorical(logits=2 * x).sample())]
        >>> head = torchcal.attach(torch.nn.Linear(3, 3), torchcal.TemperatureScaling(), loader)
        >>> head.training, any(p.requires_grad for p in head.parameters())
        (False, False)
    """
    head = CalibratedModel(model, calibrator, output, logits_key)
    if dataloader is not None:
        head.fit(dataloader, split_batch=split_batch, **fit_options)
    return head.eval().requires_grad_(False)
