"""A Lightning callback that watches calibration during training and fits a calibration head.

At the end of validation epochs, :class:`CalibrationCallback` logs calibration metrics of the
validation outputs and fits its calibrator on them, so that checkpoints hold the head of the
latest fit (with ``every_n_epochs > 1``, an epoch without a fit leaves the head of an earlier
one). ``trainer.test`` and ``trainer.predict`` then return calibrated outputs; at the end of
fitting the callback logs the validation metrics before and after calibration. Under DDP the
metrics and the fit are data-parallel: each process keeps its own validation outputs and only sums
travel (``Calibrator.fit(..., process_group=...)``).
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import math
import os
import tempfile
import uuid
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.utilities.distributed import gather_all_tensors

from torchcal._validation import check_count
from torchcal.calibrators import Calibrator, TemperatureScaling
from torchcal.calibrators.base import check_calibrator
from torchcal.distributed import ProcessGroup, all_reduce_, least_across, validate_together
from torchcal.fit import cross_validate
from torchcal.functional import (
    brier_score,
    calibration_loss,
    cross_entropy,
    error_rate,
    expected_calibration_error,
    refinement_loss,
)
from torchcal.functional.scoring import PER_SAMPLE_SCORES
from torchcal.heads import (
    CHECKPOINT_KEY,
    CalibratedModel,
    LogitsKey,
    OutputKind,
    _check_output_kind,
    _class_path,
    _load_head_state,
    _stored_heads,
    calibrate_output,
    head_checkpoint,
    replace_logits,
    scores_from_outputs,
    select_logits,
)
from torchcal.metrics import PosteriorQuality

__all__ = ["DEFAULT_METRICS", "METRIC_NAMES", "CalibrationCallback", "calibration_metrics"]

#: Metrics :func:`calibration_metrics` and the callback compute, by name.
METRIC_NAMES = ("nce", "nbs", "ece", "rcl", "error", "refinement")
#: Logged by default; ``"rcl"`` (``folds`` calibrator fits) is in the end-of-fit report anyway.
DEFAULT_METRICS = ("nce", "nbs", "ece", "refinement")
# the callback's names of PosteriorQuality's statistics
_FUSED_STATISTICS = {"nce": "nce", "nbs": "nbs", "ece": "ece", "error": "error_rate"}


def _weights_fingerprint(module: nn.Module) -> Tensor:
    """A float64 sum of each floating parameter and buffer of ``module`` (on the CPU): tells
    whether the weights changed between two moments of a fit."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    return torch.stack([t.detach().sum(dtype=torch.float64).cpu() for t in tensors]) if tensors else torch.zeros(0)


def _check_metric_names(names: Sequence[str]) -> None:
    unknown = [n for n in names if n not in METRIC_NAMES]
    if unknown:
        raise ValueError(f"unknown metrics {unknown}; choose from {METRIC_NAMES}.")


def calibration_metrics(
    scores: Tensor,
    labels: Tensor,
    calibrator: Calibrator,
    metrics: Sequence[str] = DEFAULT_METRICS,
    *,
    folds: int = 5,
    n_bins: int = 15,
    fit_options: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """Calibration metrics of ``scores: (N, K)`` with ``labels: (N,)``, as Python floats.

    - ``"nce"``, ``"nbs"``: normalised cross-entropy and Brier score (1 is the naive system that
      always outputs the class frequencies).
    - ``"ece"``: top-label expected calibration error with ``n_bins`` equal-width bins.
    - ``"rcl"``: relative calibration loss in % (Ferrer & Ramos), the share of the cross-entropy
      that ``calibrator`` removes, from out-of-fold calibrated scores by ``folds``-fold
      cross-validation (``calibrator`` is copied, never modified; ``fit_options`` go to its fit).
    - ``"error"``: error rate.
    - ``"refinement"``: cross-entropy (nats) after temperature scaling fitted on these scores
      (:func:`torchcal.functional.refinement_loss`), the early-stopping criterion of Berta et al. 2025.

    Example:
        >>> import torch, torchcal
        >>> logits = 3 * torch.randn(500, 4)
        >>> labels = torch.distributions.Categorical(logits=logits / 3).sample()
        >>> m = calibration_metrics(logits, labels, torchcal.TemperatureScaling(), ("nce", "rcl"))
        >>> sorted(m), m["rcl"] > 5  # the scores are three times too confident
        (['nce', 'rcl'], True)
    """
    _check_metric_names(metrics)
    compute: dict[str, Callable[[], Tensor]] = {
        "nce": lambda: cross_entropy(scores, labels, normalize=True),
        "nbs": lambda: brier_score(scores, labels, normalize=True),
        "ece": lambda: expected_calibration_error(scores, labels, n_bins=n_bins),
        "error": lambda: error_rate(scores, labels),
        "rcl": lambda: calibration_loss(
            scores, cross_validate(calibrator, scores, labels, folds=folds, **(fit_options or {})), labels
        ).relative,
        "refinement": lambda: refinement_loss(scores, labels),
    }
    return {name: float(compute[name]()) for name in metrics}


def _check_fit_options(calibrator: Calibrator, options: Mapping[str, Any]) -> None:
    """The names of ``options`` against ``calibrator.fit``'s keywords, and the values that are
    cheap to check, so that a typo fails before training rather than at the first fit."""
    parameters = inspect.signature(calibrator.fit).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        # the callback passes the data and the process group itself
        accepted = sorted(set(parameters) - {"logits", "labels", "process_group"})
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise ValueError(f"unknown fit_options {unknown}: {type(calibrator).__name__}.fit takes {accepted}.")
    if "loss" in options and options["loss"] not in PER_SAMPLE_SCORES:
        raise ValueError(f"fit_options['loss'] must be one of {sorted(PER_SAMPLE_SCORES)}, got {options['loss']!r}.")
    if "max_iter" in options:
        check_count(options["max_iter"], "fit_options['max_iter']")


def _batch_labels(batch: Any, key: str) -> Tensor | None:
    if isinstance(batch, Mapping):
        return batch.get(key)
    if isinstance(batch, (tuple, list)) and len(batch) >= 2 and isinstance(batch[-1], Tensor):
        return batch[-1]
    return None


class CalibrationCallback(Callback):
    """Log calibration metrics during training and attach a fitted calibration head.

    **Finding the logits (the one extractor, :meth:`extract`).** ``logits_key`` says where the
    logits are in every structured output: in what ``validation_step`` returns and in what the
    LightningModule's ``forward`` returns during ``trainer.test`` / ``trainer.predict``. A tensor
    is the logits itself; a dict is indexed by the key (default ``"logits"``), a tuple or list by
    an integer (``logits_key=0`` for ``(logits, features)``). The labels are taken from the dict
    ``validation_step`` returns (``labels_key``), else from the batch (its last element, or
    ``batch[labels_key]`` for dict batches)::

        def validation_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            self.log("val_loss", F.cross_entropy(logits, y))
            return logits  # or {"logits": logits, "labels": y}, or (logits, features) with logits_key=0

    Override :meth:`extract` for anything else.

    **Several validation dataloaders.** Only the first is used: its outputs are the ones measured
    and fitted on. The metrics are then logged as ``{prefix}{name}/dataloader_idx_0``, the name
    Lightning gives the first loader's metrics (``EarlyStopping`` / ``ModelCheckpoint`` monitor
    ``"calibration/refinement/dataloader_idx_0"``). Lightning copies whatever is logged at the end of
    a validation epoch into every loader's results, so ``trainer.validate(model, [val, test])[1]``
    holds these keys too: they are the first loader's numbers, as their names say, not the second
    loader's (the table ``trainer.validate`` prints drops the suffix, and so shows them in every
    loader's column). To measure another loader, validate on it alone:
    ``trainer.validate(model, test_loader)``.

    **When it fits (cost controls).** At the validation of every ``every_n_epochs``-th training
    epoch of ``trainer.fit`` (with ``check_val_every_n_epoch=2`` and ``every_n_epochs=2``, every
    validation) the ``metrics`` are logged as ``{prefix}{name}`` (see
    :func:`calibration_metrics`; ``"rcl"`` costs ``folds`` calibrator fits) and the calibrator is
    fitted (one fit). ``every_n_epochs=0`` fits only once, at the end of fitting, on the last
    validation epoch. ``"refinement"`` is logged every validation epoch whatever the setting (one
    temperature-scaling fit), so ``EarlyStopping(monitor=f"{prefix}refinement")`` and
    ``ModelCheckpoint`` find it every time. ``trainer.validate`` logs the metrics but refits the
    head only with ``fit_on_validate=True`` (it is the way to calibrate an already-trained model on
    a calibration loader; without the flag a test loader never leaks into the head). Where the
    weights change after the last validation (``StochasticWeightAveraging`` puts its average in at
    the end of training; training epochs after the last validation), the head is that of the
    earlier weights: the end of fitting says so, and ``trainer.validate`` with ``fit_on_validate``
    refits it.

    **Outputs that are not finite.** A validation epoch whose outputs hold NaN or infinite values
    (a diverged network, half-precision overflow) fits nothing and logs every metric as NaN, with
    a warning, so that ``EarlyStopping(check_finite=True)`` (its default) ends the run as it does
    on a NaN ``val_loss``. The head stays as it was: the end of fitting does not refit it on those
    outputs (unless a later epoch's are finite again).

    **Distributed.** Under DDP every process keeps its own validation outputs; the metrics are
    reduced from per-process sums and the calibrator is fitted data-parallel
    (``fit(..., process_group=...)``), so every process ends with the same head, that of one fit on
    all the outputs. Cross-validation is the exception: each process splits its own outputs into the
    folds (a fold is the union of the processes' folds), so a calibrator that cross-validates its
    regularisation (``StructuredVectorScaling`` / ``StructuredMatrixScaling`` by default,
    ``MatrixScaling`` / ``DirichletCalibration`` with a regulariser and ``reg_lambda=None``) can
    select another strength, and fit another head, than a one-process run on the same outputs; the
    RCL and the report's "after" row, which are out-of-fold, can differ slightly too. Fix
    ``reg_lambda`` for a head that does not depend on the number of processes. Calibrators that
    cannot fit data-parallel (histogram binning, isotonic regression) fall back, with a warning, to
    gathering all outputs on every process. A ``DistributedSampler`` that pads the validation set
    (its size is not a multiple of the number of processes) repeats samples, which changes the head:
    the callback warns. With ``ddp_spawn`` (and ``ddp_fork``) the fitted head and the report come
    back to the main process after ``trainer.fit`` (as the weights do; not after ``trainer.test``
    and the like, whose ``ckpt_path`` weights stay in the workers too). A weights-only checkpoint
    that the main process saves after such a fit (``trainer.save_checkpoint(path,
    weights_only=True)``) has no head: Lightning calls only the module's hook there, which the
    workers wrapped (see **Checkpoints**); save a full checkpoint there, or let ``ModelCheckpoint``
    save during the fit.

    **Test and predict.** While ``trainer.test`` / ``trainer.predict`` run, the LightningModule's
    ``forward`` returns calibrated outputs of the same kind and structure as its own (see
    :mod:`torchcal.heads`), so ``test_step`` / ``predict_step`` must call ``self(x)``. Training and
    validation always see the raw outputs, and nothing stays attached after the trainer finishes:
    for plain-PyTorch use or export, wrap the network with :meth:`calibrated_model`.

    **At the end of fitting** the head is refitted if the last validation epoch was not a fit
    epoch, and the validation metrics before and after calibration are logged as
    ``{prefix}before/{name}`` and ``{prefix}after/{name}`` and kept in ``report_`` (``report=False``
    skips it). "after" uses out-of-fold calibrated scores (``folds``-fold cross-validation), so it
    estimates the effect on unseen data; the same out-of-fold scores give the "before" RCL, and
    nothing is refitted on already calibrated scores ("after" has no RCL or refinement).
    :meth:`table` formats the report.

    **Checkpoints** hold the head of the latest fit under the top-level key
    ``torchcal.heads.CHECKPOINT_KEY``, in a dict by the callback's :attr:`state_key` (its calibrator
    class and prefix), so that several callbacks in one Trainer keep their own heads (one of them,
    at most, with ``attach=True``: the head the outputs go through); weights-only
    checkpoints (``ModelCheckpoint(save_weights_only=True)``) hold them too: Lightning calls a
    callback's checkpoint hooks for full checkpoints only, so :meth:`setup` wraps the
    LightningModule's ``on_save_checkpoint`` / ``on_load_checkpoint`` (after the module's own) to
    write and restore the heads. A callback restores its own head on resume and in
    ``trainer.test(..., ckpt_path=...)``, or the only head a checkpoint holds (one saved with
    another prefix, by no other callback of the Trainer), and refuses a head fitted on the other
    domain (``output="probs"`` against ``"logits"`` / ``"log_probs"``);
    ``CalibratedModel.from_checkpoint(path, network)`` loads a head without Lightning (``prefix=``
    chooses among several). With ``every_n_epochs=0`` save a checkpoint after fitting
    (``trainer.save_checkpoint``).

    Args:
        calibrator: the head, unfitted. The default, temperature scaling, keeps every argmax.
        metrics: names from :data:`METRIC_NAMES`.
        output: what the module's ``forward`` returns: ``"logits"``, ``"log_probs"`` or ``"probs"``.
        attach: apply the head during ``trainer.test`` / ``trainer.predict`` (one callback of a
            Trainer at most).
        every_n_epochs: fit and log at the validation of every this many training epochs; 0: only at
            the end of fitting.
        fit_on_validate: let ``trainer.validate`` refit the head on the loader it is given.
        report: compute the before/after report at the end of fitting.
        folds: cross-validation folds of ``"rcl"`` and of the report.
        n_bins: ECE bins.
        prefix: prefix of the logged names.
        logits_key: where the logits are in structured outputs (see above).
        labels_key: key of the labels in the dict ``validation_step`` returns or in dict batches.
        fit_options: passed to the calibrator's ``fit`` (``loss``, ``priors``, ``max_iter``).

    Example:
        >>> import torchcal
        >>> from torchcal.lightning import CalibrationCallback
        >>> callback = CalibrationCallback(torchcal.TemperatureScaling(), every_n_epochs=5)
        >>> # trainer = Trainer(callbacks=[callback, EarlyStopping("calibration/refinement")])
        >>> # trainer.fit(model, train_loader, val_loader); print(callback.table())
        >>> # trainer.test(model, test_loader)  # calibrated test outputs
    """

    def __init__(
        self,
        calibrator: Calibrator | None = None,
        metrics: Sequence[str] = DEFAULT_METRICS,
        *,
        output: OutputKind = "logits",
        attach: bool = True,
        every_n_epochs: int = 1,
        fit_on_validate: bool = False,
        report: bool = True,
        folds: int = 5,
        n_bins: int = 15,
        prefix: str = "calibration/",
        logits_key: LogitsKey = "logits",
        labels_key: str = "labels",
        fit_options: Mapping[str, Any] | None = None,
    ) -> None:
        calibrator = TemperatureScaling() if calibrator is None else check_calibrator(calibrator)
        _check_metric_names(metrics)
        _check_output_kind(output)
        if isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int) or every_n_epochs < 0:
            raise ValueError(f"every_n_epochs must be an integer >= 0 (0: only at the end of fitting), got {every_n_epochs!r}.")
        folds = check_count(folds, "folds (cross-validation folds of the RCL and the report)", minimum=2)
        n_bins = check_count(n_bins, "n_bins")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a string (the logged names start with it; '' for none), got {prefix!r}.")
        if not (logits_key is None or isinstance(logits_key, str) or (isinstance(logits_key, int) and not isinstance(logits_key, bool))):
            raise TypeError(f"logits_key must be a dict key (str), a tuple index (int) or None, got {logits_key!r}.")
        if not isinstance(labels_key, str):
            raise TypeError(f"labels_key must be a string (a key of dict outputs or batches), got {labels_key!r}.")
        _check_fit_options(calibrator, fit_options or {})
        self._calibrator = calibrator
        self.metrics = tuple(metrics)
        self.output = output
        self.attach = attach
        self.every_n_epochs = every_n_epochs
        self.fit_on_validate = fit_on_validate
        self.report = report
        self.folds = folds
        self.n_bins = n_bins
        self.prefix = prefix
        self.logits_key = logits_key
        self.labels_key = labels_key
        self.fit_options = dict(fit_options or {})
        self._report: dict[str, dict[str, float]] | None = None
        self._batches: list[tuple[Tensor, Tensor]] = []
        # the latest validation epoch's scores, labels and process group, and whether the head was fitted on it
        self._latest: tuple[Tensor, Tensor, ProcessGroup | None] | None = None
        self._latest_quality: dict[str, float] | None = None  # posterior_quality of those scores
        self._latest_weights: Tensor | None = None  # the network's weights then (_weights_fingerprint)
        self._validated_weights: Tensor | None = None  # those of this validation epoch's first batch
        self._head_is_current = False
        self._trainer: Trainer | None = None
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._calibrated_calls = 0
        self._warned: set[str] = set()
        # ddp_spawn / ddp_fork run the trainer in child processes: rank 0 leaves the head here
        self._owner_pid = os.getpid()
        self._handoff_path = os.path.join(tempfile.gettempdir(), f"torchcal-head-{uuid.uuid4().hex}.pt")
        atexit.register(_remove_if_present, self._handoff_path)  # a head that nothing in the main process read

    @property
    def calibrator(self) -> Calibrator:
        """The calibration head (fitted once a validation epoch, or the end of fitting, has run)."""
        self._receive_handoff()
        return self._calibrator

    @property
    def report_(self) -> dict[str, dict[str, float]] | None:
        """``{"before": {...}, "after": {...}}`` validation metrics at the end of the last fit."""
        self._receive_handoff()
        return self._report

    @property
    def state_key(self) -> str:
        return self._generate_state_key(calibrator=type(self._calibrator).__name__, prefix=self.prefix)

    # ---------------------------------------------------------------------------- collection
    def extract(self, outputs: Any, batch: Any) -> tuple[Tensor, Tensor] | None:
        """``(outputs (B, K), labels (B,))`` of one validation batch, or ``None`` if absent.

        ``outputs`` is what ``validation_step`` returned; see the class docs for where the logits
        and labels are looked for. Override to take them from elsewhere.
        """
        if outputs is None:
            return None
        try:
            logits = select_logits(outputs, self.logits_key)
        except TypeError:
            return None
        if isinstance(outputs, Mapping) and self.labels_key in outputs:
            labels = outputs[self.labels_key]
        else:
            labels = _batch_labels(batch, self.labels_key)
        if logits.ndim != 2 or labels is None:
            return None
        return logits, labels

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.world_size > 1:
            loaders = trainer.val_dataloaders  # (the callback reads the first loader's outputs)
            first = next(iter(loaders.values())) if isinstance(loaders, Mapping) else loaders[0] if isinstance(loaders, (list, tuple)) else loaders
            sampler = getattr(first, "sampler", None)
            if isinstance(sampler, DistributedSampler) and not sampler.drop_last and sampler.total_size != len(sampler.dataset):  # type: ignore[arg-type]
                self._warn_once(
                    "padding",
                    f"the DistributedSampler pads the validation set of {len(sampler.dataset)} samples to "  # type: ignore[arg-type]
                    f"{sampler.total_size} by repeating samples, so the calibration head and metrics count "
                    f"those twice: make the validation set size a multiple of {sampler.num_replicas}, or give "
                    f"each process its own part of it (use_distributed_sampler=False).",
                )

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._batches = []

    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if dataloader_idx != 0:
            return
        found = self.extract(outputs, batch)
        if found is None:  # (the sanity check's batches too: they are kept for nothing else)
            raise RuntimeError(self._not_found_message(outputs, batch))
        if not trainer.sanity_checking:
            logits, labels = found
            self._batches.append((_own_storage(logits.detach()), _own_storage(labels.detach())))
            if batch_idx == 0 and trainer.state.fn == TrainerFn.FITTING:
                # the weights that give the outputs: read here, where every callback's epoch-start hook
                # has run (EMA weight averaging puts its average in for validation there, and takes it
                # out again in its epoch-end hook, which may run before this callback's)
                self._validated_weights = _weights_fingerprint(pl_module)

    def _not_found_message(self, outputs: Any, batch: Any) -> str:
        """Why the default :meth:`extract` found nothing: no logits, logits of the wrong shape, or no labels."""
        override = "or subclass CalibrationCallback and override extract()."
        try:
            logits = None if outputs is None else select_logits(outputs, self.logits_key)
        except TypeError:
            logits = None
        if logits is None:
            return (
                f"CalibrationCallback found no validation logits: validation_step returned "
                f"{type(outputs).__name__}. Return the logits (B, K), e.g. `return logits` or "
                f"`return {{'{self.logits_key}': logits, '{self.labels_key}': y}}` (set logits_key=0 for "
                f"(logits, features) tuples), with labels in the batch or the dict, {override}"
            )
        if logits.ndim != 2:
            return (
                f"CalibrationCallback needs validation logits of shape (B, K), one column per class, got "
                f"{tuple(logits.shape)}: for one binary score per sample return "
                f"torchcal.data.binary_scores_to_logits(scores, kind=...) from forward, {override}"
            )
        where = f"a dict with the keys {sorted(map(str, batch))}" if isinstance(batch, Mapping) else type(batch).__name__
        return (
            f"CalibrationCallback found the validation logits but no labels: labels_key={self.labels_key!r} is "
            f"neither in what validation_step returned nor in the batch ({where}). Set labels_key= the key of "
            f"the labels, return {{'{self.logits_key}': logits, '{self.labels_key}': y}} from validation_step, {override}"
        )

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not self._batches:
            return
        outputs, labels, group = self._epoch_outputs()
        self._batches = []
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            fit = self.every_n_epochs > 0 and (trainer.current_epoch + 1) % self.every_n_epochs == 0
            names = self.metrics if fit else tuple(m for m in self.metrics if m == "refinement")
        else:  # trainer.validate: an evaluation, unless asked to refit
            fit, names = self.fit_on_validate, self.metrics
        # (counted over the group: every process then skips the fit's collectives together)
        nonfinite = int(all_reduce_((~torch.isfinite(outputs)).any(1).sum(dtype=torch.float64).reshape(1), group)[0])
        if nonfinite:
            self._warn_once("nonfinite", (
                f"CalibrationCallback: {nonfinite} validation rows hold NaN or infinite outputs (a diverged network? half-"
                f"precision overflow?): no calibration head is fitted on them and the calibration metrics are logged as "
                f"NaN, on which EarlyStopping(check_finite=True) stops."))
            if fitting:  # (nor does the end of fitting, with these weights)
                self._latest = self._latest_quality = None
            self._log(trainer, pl_module, dict.fromkeys(names, math.nan))
            return
        with self._fit_warnings_once():
            # (probabilities that one process refuses stop every process: the others would wait in the fit's sums)
            scores = validate_together(lambda: scores_from_outputs(outputs, self.output), group, outputs)
            if fitting:
                self._latest, self._head_is_current = (scores, labels, group), False
                self._latest_weights = self._validated_weights
            if fit:
                self._fit_head(scores, labels, group)
            quality = self._quality(scores, labels, group) if any(n in _FUSED_STATISTICS or n == "rcl" for n in names) else None
            values = self._metrics(scores, labels, names, group, quality, head_fitted_here=fit)
        if fitting:
            self._latest_quality = quality  # the end-of-fit report reuses it
        self._log(trainer, pl_module, values)

    def _log(self, trainer: Trainer, pl_module: LightningModule, values: Mapping[str, float]) -> None:
        """Log the epoch's ``values`` (identical on every process) under the callback's names."""
        # Lightning puts what an epoch-end hook logs into the results of every loader, so with
        # several loaders the names say that the values are the first loader's (see the class docs)
        suffix = "/dataloader_idx_0" if len(trainer.num_val_batches) > 1 else ""
        for name, value in values.items():
            # sync_dist averages identical values (exactly)
            pl_module.log(self.prefix + name + suffix, value, sync_dist=True, add_dataloader_idx=False)

    def _epoch_outputs(self) -> tuple[Tensor, Tensor, ProcessGroup | None]:
        """This process's outputs (N, K) and labels (N,), and the process group to reduce over:
        ``None`` outside DDP, or when the calibrator cannot fit data-parallel and the outputs of
        all processes are gathered instead (in rank order, so every process fits the same head)."""
        outputs = torch.cat([s for s, _ in self._batches])
        labels = torch.cat([y for _, y in self._batches])
        group: ProcessGroup | None = None
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            if self._calibrator._supports_process_group:
                group = torch.distributed.group.WORLD
            else:
                self._warn_once(
                    "gather",
                    f"{type(self._calibrator).__name__} cannot be fitted data-parallel: every process gathers "
                    f"all validation outputs and repeats the same fit and metrics.",
                )
                outputs = torch.cat(gather_all_tensors(outputs))  # pads and trims uneven sizes
                labels = torch.cat(gather_all_tensors(labels))
        return outputs, labels, group

    def _metrics(
        self,
        scores: Tensor,
        labels: Tensor,
        names: Sequence[str],
        group: ProcessGroup | None,
        quality: Mapping[str, float] | None,
        head_fitted_here: bool = False,
    ) -> dict[str, float]:
        """:func:`calibration_metrics` of the union of the processes' scores, from per-process sums.

        NCE, NBS, ECE, the error rate and the RCL's cross-entropy come from ``quality``, the one
        fused pass over these scores (:meth:`_quality`; needed for those names). The refinement
        loss is the minimised objective of a temperature-scaling fit, so it costs that fit and no
        pass after it; ``head_fitted_here``: the head was just fitted on these scores, and a plain
        temperature-scaling head is then that fit, which is not repeated."""
        values: dict[str, float] = {}
        if quality is not None:
            values.update({name: quality[_FUSED_STATISTICS[name]] for name in names if name in _FUSED_STATISTICS})
            if "rcl" in names:
                values["rcl"] = math.nan
                if self._enough_for_folds(labels, group):
                    calibrated = self._quality(self._out_of_fold(scores, labels, group), labels, group)
                    values["rcl"] = _relative_calibration_loss(quality, calibrated)
        if "refinement" in names:
            if head_fitted_here and self._head_is_plain_temperature_scaling():
                scaling = self._calibrator
            else:
                scaling = TemperatureScaling().fit(scores, labels, process_group=group)
            assert scaling.fit_record_ is not None
            values["refinement"] = scaling.fit_record_.loss  # the mean log-loss at the fitted T, over all processes
        return {name: values[name] for name in names}

    def _quality(self, scores: Tensor, labels: Tensor, group: ProcessGroup | None) -> dict[str, float]:
        """:func:`posterior_quality` of the union of the processes' scores: one fused pass in the
        precision of the scores, as the fits run (float32 terms summed in float64: ~1e-7
        relative, and four times faster than float64 exponentials on the CPU)."""
        quality = PosteriorQuality(
            scores.shape[1],
            n_bins=self.n_bins,
            precision="float64" if scores.dtype == torch.float64 else "float32",
            sync_on_compute=group is not None,
        ).to(scores.device)
        # (a process's bad outputs raise on every process: the others would wait in the sync)
        validate_together(lambda: quality.update(scores, labels), group, scores)
        return {name: float(value) for name, value in quality.compute().items()}

    def _enough_for_folds(self, labels: Tensor, group: ProcessGroup | None) -> bool:
        """Whether every process holds at least ``folds`` validation samples, as the RCL's and the
        report's cross-validation needs; says once where not (it raised at the end of trainer.fit,
        after training: 4 samples with fast_dev_run, or 8 over two ddp processes)."""
        fewest = int(least_across(labels.shape[0], group, labels.device))
        if fewest >= self.folds:
            return True
        where = "on every process " if group is not None else ""
        self._warn_once("folds", f"CalibrationCallback: the RCL and the end-of-fit report cross-validate the calibrator "
                                 f"with {self.folds} folds, which needs at least {self.folds} validation samples {where}"
                                 f"(the fewest: {fewest}); they are left out (the RCL logged as NaN). Validate on more "
                                 f"samples, or pass fewer folds.")
        return False

    def _out_of_fold(self, scores: Tensor, labels: Tensor, group: ProcessGroup | None) -> Tensor:
        """Out-of-fold calibrated scores; under DDP each fold is the union of the processes' folds,
        and every fold's calibrator is fitted data-parallel."""
        return cross_validate(self._calibrator, scores, labels, folds=self.folds, process_group=group, **self.fit_options)

    def _head_is_plain_temperature_scaling(self) -> bool:
        """Whether the head's fit is the one :func:`refinement_loss` makes."""
        options = dict(self.fit_options)
        return type(self._calibrator) is TemperatureScaling and options.pop("loss", "log") == "log" and not options

    def _fit_head(self, scores: Tensor, labels: Tensor, group: ProcessGroup | None) -> None:
        self._calibrator.fit(scores, labels, process_group=group, **self.fit_options)
        self._head_is_current = True

    def _warn_once(self, key: str, message: str, category: type[Warning] = UserWarning) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message, category=category)

    @contextlib.contextmanager
    def _fit_warnings_once(self) -> Iterator[None]:
        """The block's warnings (its fits'), each distinct one once per callback and named as the
        callback's: a head fitted every validation epoch, with its folds' fits, repeated them (23
        lines in 3 epochs of a validation set without one class), at a line in Lightning. Outputs
        that look like probabilities but were declared log-domain are said once, by the first check
        (the outputs', which names the callback's ``output``), not again by the fit and the metrics."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        for w in caught:
            message = str(w.message)
            key = "probabilities declared log-domain" if "look like probabilities" in message else message
            self._warn_once(key, message if message.startswith("CalibrationCallback") else f"CalibrationCallback: {message}",
                            w.category)

    # ------------------------------------------------------------------------------ the head
    def calibrated_model(self, model: nn.Module) -> CalibratedModel:
        """``CalibratedModel(model, head)``: the network with this callback's fitted head, in eval
        mode, as :meth:`CalibratedModel.attach` returns it (after ``trainer.fit`` the network is in
        training mode: its dropout made two calls differ)."""
        return CalibratedModel(model, self.calibrator, self.output, self.logits_key).eval()

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        others = [c for c in trainer.callbacks if isinstance(c, CalibrationCallback) and c is not self]  # type: ignore[attr-defined]
        if any(other.state_key == self.state_key for other in others):
            raise ValueError(
                f"two CalibrationCallbacks with the same calibrator class and prefix {self.prefix!r} would log "
                f"the same names and save their heads under one key: give each its own prefix."
            )
        if self.attach and any(other.attach for other in others):
            raise ValueError(
                "several CalibrationCallbacks with attach=True would each calibrate the test and predict outputs, "
                "one head after the other: keep attach=True on the one whose head the outputs should go through, "
                "and set attach=False on the others."
            )
        self._receive_handoff(forked=os.getpid() != self._owner_pid)
        self._trainer = trainer
        if self.attach and self._hook is None:
            self._hook = pl_module.register_forward_hook(self._calibrate_forward)
        for hook in ("on_save_checkpoint", "on_load_checkpoint"):
            if not isinstance(vars(pl_module).get(hook), _WithCalibrationHeads):
                setattr(pl_module, hook, _WithCalibrationHeads(pl_module, hook))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        launched = isinstance(trainer.strategy.launcher, _MultiProcessingLauncher) and os.getpid() != self._owner_pid
        # A fit hands its head back, as Lightning hands back a fit's weights; so does a validate
        # that refitted it on the main process's own weights (no ckpt_path). After
        # trainer.test(ckpt_path=...) the main process would hold that checkpoint's head on the
        # final weights.
        refitted = stage == "validate" and self.fit_on_validate and trainer.ckpt_path is None
        if launched and (stage == "fit" or refitted) and trainer.global_rank == 0 and self._calibrator.is_fitted:
            torch.save({"calibrator": self._calibrator.state_dict(), "report": self._report}, self._handoff_path)

    def _receive_handoff(self, forked: bool = False) -> None:
        """In the main process, take the head that a ``ddp_spawn``/``ddp_fork`` worker left (the
        file goes). ``forked``: in a worker that ``ddp_fork`` forked from it before it read the
        file (its ``trainer.test`` after a fit ran without the head): once, at setup, leaving the
        file to the main process (read again later, a second fit's checkpoints took the first
        fit's head back)."""
        if (os.getpid() == self._owner_pid or forked) and os.path.exists(self._handoff_path):
            state = torch.load(self._handoff_path, weights_only=True)
            if os.getpid() == self._owner_pid:
                os.remove(self._handoff_path)
            self._calibrator.load_state_dict(state["calibrator"])
            self._report = state["report"]

    def __getstate__(self) -> dict[str, Any]:
        self._receive_handoff()  # a later spawned run (e.g. trainer.test) must get the fitted head
        # Not the trainer (setup sets it again) nor any epoch's outputs: a deep copy of the module
        # (EMA or SWA weight averaging), which copies the forward hook and so this callback,
        # copied the whole Trainer with its datasets and failed on one holding an open file; and
        # under DDP the last outputs hold the process group, which cannot be copied.
        return {**self.__dict__, "_trainer": None, "_batches": [], "_latest": None, "_latest_quality": None}

    def _calibrate_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        trainer = self._trainer
        if trainer is None or not (trainer.testing or trainer.predicting) or not self._calibrator.is_fitted:
            return None
        self._calibrated_calls += 1
        logits = select_logits(output, self.logits_key)
        calibrated = calibrate_output(self._calibrator.to(logits.device), logits, self.output)
        return replace_logits(output, self.logits_key, calibrated)

    def _start_calibrated_run(self, what: str) -> None:
        self._calibrated_calls = 0
        if self.attach and not self._calibrator.is_fitted:
            warnings.warn(
                f"CalibrationCallback has no fitted head, so {what} outputs are not calibrated: fit "
                f"first, or pass ckpt_path= a checkpoint saved with this callback.",
                stacklevel=2,
            )

    def _end_calibrated_run(self, what: str) -> None:
        if self.attach and self._calibrator.is_fitted and self._calibrated_calls == 0:
            warnings.warn(
                f"the LightningModule's forward was never called during {what}, so its outputs "
                f"were not calibrated: call self(x) in {what}_step, or calibrate the network "
                f"explicitly with callback.calibrated_model(net).",
                stacklevel=2,
            )

    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_calibrated_run("test")

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end_calibrated_run("test")

    def on_predict_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_calibrated_run("predict")

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end_calibrated_run("predict")

    # ---------------------------------------------------------------------- before / after
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # an earlier fit's outputs and report are not this fit's (a second fit without validation
        # logged them again, as its own, at its own step)
        self._latest = self._latest_quality = self._report = self._latest_weights = None
        self._warned.discard("stale")  # (said of each fit whose weights changed after its last validation)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._latest is None:
            if not self._calibrator.is_fitted and "nonfinite" not in self._warned:  # (said here, not first at trainer.test)
                self._warn_once("no-validation", "CalibrationCallback: no validation epoch ran in trainer.fit, so there "
                                "were no outputs to fit the calibration head on; give trainer.fit val_dataloaders "
                                "(and limit_val_batches > 0).")
            return
        scores, labels, group = self._latest
        if self._latest_weights is not None and not torch.equal(_weights_fingerprint(pl_module), self._latest_weights):
            self._warn_once("stale", (
                "the network's weights changed after the last validation epoch (StochasticWeightAveraging puts its "
                "average in at the end of training; or training epochs ran after the last validation), so the "
                "calibration head and the end-of-fit report belong to the earlier weights: refit the head on the final "
                "weights with callback.fit_on_validate = True and trainer.validate(model, val_dataloader), or "
                "validate after the last training epoch."))
        with self._fit_warnings_once():
            if not self._head_is_current:
                self._fit_head(scores, labels, group)
            if not self.report or not self._enough_for_folds(labels, group):
                return
            names = [m for m in self.metrics if m not in ("rcl", "refinement")]
            # the last fit epoch's pass on these scores, or a new one when the last epoch fitted nothing
            raw = self._latest_quality if self._latest_quality is not None else self._quality(scores, labels, group)
            calibrated = self._quality(self._out_of_fold(scores, labels, group), labels, group)
        before = {name: raw[_FUSED_STATISTICS[name]] for name in names}
        before["rcl"] = _relative_calibration_loss(raw, calibrated)
        self._report = {"before": before, "after": {name: calibrated[_FUSED_STATISTICS[name]] for name in names}}
        flat = {f"{self.prefix}{when}/{name}": v for when, values in self._report.items() for name, v in values.items()}
        for logger in trainer.loggers:
            logger.log_metrics(flat, step=trainer.global_step)

    def table(self) -> str:
        """The before/after metrics of the last fit as a text table ("-": not computed)."""
        report = self.report_
        if report is None:
            raise RuntimeError("no report yet: it is made at the end of trainer.fit, after a validation epoch.")
        before, after = report["before"], report["after"]
        lines = [f"{'metric':<8}{'before':>10}{'after':>10}"]
        lines += [f"{name.upper():<8}{_cell(before, name)}{_cell(after, name)}" for name in before]
        return "\n".join(lines)

    # ----------------------------------------------------------------------------- checkpoint
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # The module's hook (see setup) writes the head too; this one covers the main process after
        # ddp_spawn, whose module was never set up.
        self._save_head(checkpoint)

    def _save_head(self, checkpoint: dict[str, Any]) -> None:
        calibrator = self.calibrator  # (after ddp_spawn, the head the worker handed back)
        if calibrator.is_fitted:
            entry = {**head_checkpoint(calibrator, self.output, self.logits_key), "prefix": self.prefix}
            checkpoint.setdefault(CHECKPOINT_KEY, {})[self.state_key] = entry

    def _load_head(self, checkpoint: dict[str, Any], siblings: Collection[str] = ()) -> None:
        """Restore this callback's head from ``checkpoint``; ``siblings``: the state keys of the
        trainer's other CalibrationCallbacks, whose heads are theirs alone."""
        heads = {key: entry for key, entry in _stored_heads(checkpoint).items() if key == self.state_key or key not in siblings}
        entry = heads.get(self.state_key)
        if entry is None and len(heads) == 1:
            (entry,) = heads.values()  # an old checkpoint, or a callback with another prefix resuming
        if entry is None and heads:
            raise ValueError(
                f"the checkpoint holds the heads of the CalibrationCallbacks {sorted(heads)}, none of them this "
                f"callback's ({self.state_key}): build it with the calibrator class and prefix of the one to restore."
            )
        if entry is None and self.calibrator.is_fitted:
            warnings.warn(
                "the checkpoint holds no calibration head (it was saved before any fit, e.g. with "
                "every_n_epochs=0 before the end of fitting), so this callback keeps the head of its latest "
                "fit, made on other weights: test and predict outputs go through it. Fit the head again for "
                "these weights (trainer.validate with fit_on_validate=True), or use a checkpoint saved after it.",
                stacklevel=2,
            )
        if entry is not None:
            if entry["calibrator"] != _class_path(self._calibrator):
                raise TypeError(
                    f"the checkpoint holds a {entry['calibrator']} head but this callback's calibrator is a "
                    f"{type(self._calibrator).__name__}: build the callback with the checkpoint's calibrator class."
                )
            if (entry["output"] == "probs") != (self.output == "probs"):  # "logits" and "log_probs" are read alike
                raise ValueError(
                    f"the checkpoint's head was fitted on outputs of kind {entry['output']!r} but this callback has "
                    f"output={self.output!r}, so it would calibrate the wrong kind of scores: build the callback with "
                    f"output= the kind the LightningModule's forward returns ({entry['output']!r} when it saved the head)."
                )
            _load_head_state(self._calibrator, entry, "build the callback's calibrator with the options of the one that saved the head")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "calibrator" in state_dict:  # checkpoints of torchcal <= 0.x kept the head in the callback state
            self._calibrator.load_state_dict(state_dict["calibrator"])


class _WithCalibrationHeads:
    """A LightningModule's ``on_save_checkpoint`` or ``on_load_checkpoint``, followed by the
    trainer's CalibrationCallbacks writing or restoring their heads.

    Lightning calls a callback's checkpoint hooks only for full checkpoints, but the module's for
    every one, weights-only ones (``ModelCheckpoint(save_weights_only=True)``) included; so
    :meth:`CalibrationCallback.setup` puts this in the module's place, as an instance attribute
    over the class's hook, which it calls first."""

    def __init__(self, module: LightningModule, hook: str) -> None:
        self.module = module
        self.hook = hook

    def __call__(self, checkpoint: dict[str, Any]) -> None:
        getattr(type(self.module), self.hook)(self.module, checkpoint)
        callbacks = [c for c in self.module.trainer.callbacks if isinstance(c, CalibrationCallback)]  # type: ignore[attr-defined]
        for callback in callbacks:
            if self.hook == "on_save_checkpoint":
                callback._save_head(checkpoint)
            else:
                callback._load_head(checkpoint, siblings={c.state_key for c in callbacks if c is not callback})


def _own_storage(t: Tensor) -> Tensor:
    """``t``, or a copy where it is a view into a larger tensor (``self(x)[:, -1]`` of a sequence
    model's (B, T, K) outputs kept all T steps of every batch until the epoch's end)."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def _remove_if_present(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def _cell(values: Mapping[str, float], name: str) -> str:
    return f"{values[name]:>10.4f}" if name in values else f"{'-':>10}"


def _relative_calibration_loss(raw: Mapping[str, float], calibrated: Mapping[str, float]) -> float:
    """RCL in %: the share of the raw cross-entropy that calibration removes (NaN for a raw
    cross-entropy of 0, as ``functional.calibration_loss`` gives)."""
    if raw["cross_entropy"] == 0:
        return math.nan
    return 100 * (1 - calibrated["cross_entropy"] / raw["cross_entropy"])
