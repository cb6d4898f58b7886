"""A Lightning callback that watches calibration during training and fits a calibration head.

At the end of every validation epoch, :class:`CalibrationCallback` gathers the validation scores
and labels from all processes, logs calibration metrics (:func:`calibration_metrics`) and fits its
calibrator on them, so the head always matches the latest validation and any checkpoint holds the
head for its weights. ``trainer.test`` and ``trainer.predict`` then return calibrated outputs; at
the end of fitting the callback logs the validation metrics before and after calibration.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torchmetrics.utilities.distributed import gather_all_tensors

from torchcal.calibrators import Calibrator, TemperatureScaling
from torchcal.fit import cross_validate
from torchcal.functional import brier_score, calibration_loss, cross_entropy, error_rate, expected_calibration_error
from torchcal.heads import CalibratedModel, OutputKind, _check_output_kind, calibrate_output, scores_from_outputs

__all__ = ["DEFAULT_METRICS", "METRIC_NAMES", "CalibrationCallback", "calibration_metrics"]

#: Metrics :func:`calibration_metrics` computes, by name.
METRIC_NAMES = ("nce", "nbs", "ece", "rcl", "error")
DEFAULT_METRICS = ("nce", "nbs", "ece", "rcl")


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

    Example:
        >>> import torch, torchcal
        >>> logits = 3 * torch.randn(500, 4)
        >>> labels = torch.distributions.Categorical(logits=logits / 3).sample()
        >>> m = calibration_metrics(logits, labels, torchcal.TemperatureScaling())
        >>> sorted(m), m["rcl"] > 5  # the scores are three times too confident
        (['ece', 'nbs', 'nce', 'rcl'], True)
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
    }
    return {name: float(compute[name]()) for name in metrics}


class CalibrationCallback(Callback):
    """Log calibration metrics every validation epoch and attach a fitted calibration head.

    **Providing the scores.** ``validation_step`` returns a dict holding the network's outputs
    (B, K) and the labels (B,) under ``logits_key`` and ``labels_key``::

        def validation_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            self.log("val_loss", F.cross_entropy(logits, y))
            return {"logits": logits, "labels": y}

    or a subclass overrides :meth:`extract`. Only the first validation dataloader is used.

    **Every validation epoch** (not the sanity check) the scores of all processes are gathered,
    the metrics are logged as ``{prefix}{name}`` (see :func:`calibration_metrics`; ``"rcl"``
    costs ``folds`` calibrator fits) and the calibrator is fitted on them (one more fit). Every
    process ends with the same head. With a ``DistributedSampler``, make the validation set size a
    multiple of the number of processes: the sampler pads it by repeating samples otherwise.

    **Test and predict.** While ``trainer.test`` / ``trainer.predict`` run, the LightningModule's
    ``forward`` returns calibrated outputs of the same kind as its own (see :mod:`torchcal.heads`),
    so ``test_step`` / ``predict_step`` must call ``self(x)``. Training and validation always see
    the raw outputs, and nothing stays attached to the module after the trainer finishes: for
    plain-PyTorch use or export, wrap the network with :meth:`calibrated_model`. To calibrate an
    already-trained model, run ``trainer.validate(model, calibration_loader)`` with the callback.

    **At the end of fitting** the latest validation metrics before and after calibration are
    logged as ``{prefix}before/{name}`` and ``{prefix}after/{name}`` and kept in ``report_``;
    "after" uses out-of-fold calibrated scores, so it estimates the effect on unseen data.
    :meth:`table` formats them.

    **Checkpoints** store the fitted head; it is restored on resume and by
    ``trainer.test(..., ckpt_path=...)``.

    Args:
        calibrator: the head, unfitted. The default, temperature scaling, keeps every argmax.
        metrics: names from ``"nce"``, ``"nbs"``, ``"ece"``, ``"rcl"``, ``"error"``.
        output: what the module's ``forward`` returns: ``"logits"``, ``"log_probs"`` or ``"probs"``.
        attach: apply the head during ``trainer.test`` / ``trainer.predict``.
        folds: cross-validation folds of ``"rcl"`` and of the "after" metrics.
        n_bins: ECE bins.
        prefix: prefix of the logged names.
        logits_key, labels_key: keys of the dict ``validation_step`` returns.
        fit_options: passed to the calibrator's ``fit`` (``loss``, ``priors``, ``max_iter``).

    Example:
        >>> import torchcal
        >>> from torchcal.lightning import CalibrationCallback
        >>> callback = CalibrationCallback(torchcal.TemperatureScaling(), metrics=("nce", "ece"))
        >>> # trainer = Trainer(callbacks=[callback]); trainer.fit(model, train_loader, val_loader)
        >>> # print(callback.table()); trainer.test(model, test_loader)  # calibrated test outputs
    """

    def __init__(
        self,
        calibrator: Calibrator | None = None,
        metrics: Sequence[str] = DEFAULT_METRICS,
        *,
        output: OutputKind = "logits",
        attach: bool = True,
        folds: int = 5,
        n_bins: int = 15,
        prefix: str = "calibration/",
        logits_key: str = "logits",
        labels_key: str = "labels",
        fit_options: Mapping[str, Any] | None = None,
    ) -> None:
        calibrator = TemperatureScaling() if calibrator is None else calibrator
        if not isinstance(calibrator, Calibrator):
            raise TypeError(f"calibrator must be a torchcal calibrator, got {type(calibrator).__name__}.")
        _check_metric_names(metrics)
        _check_output_kind(output)
        self.calibrator = calibrator
        self.metrics = tuple(metrics)
        self.output = output
        self.attach = attach
        self.folds = folds
        self.n_bins = n_bins
        self.prefix = prefix
        self.logits_key = logits_key
        self.labels_key = labels_key
        self.fit_options = dict(fit_options or {})
        #: ``{"before": {...}, "after": {...}}`` validation metrics at the end of the last fit.
        self.report_: dict[str, dict[str, float]] | None = None
        self._batches: list[tuple[Tensor, Tensor]] = []
        self._latest: tuple[Tensor, Tensor, dict[str, float]] | None = None  # scores, labels, metrics
        self._trainer: Trainer | None = None
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._calibrated_calls = 0

    @property
    def state_key(self) -> str:
        return self._generate_state_key(calibrator=type(self.calibrator).__name__, prefix=self.prefix)

    # ---------------------------------------------------------------------------- collection
    def extract(self, outputs: Any, batch: Any) -> tuple[Tensor, Tensor] | None:
        """``(outputs (B, K), labels (B,))`` of one validation batch, or ``None`` if absent.

        Override to take them from elsewhere; ``outputs`` is what ``validation_step`` returned.
        """
        if isinstance(outputs, Mapping) and self.logits_key in outputs and self.labels_key in outputs:
            return outputs[self.logits_key], outputs[self.labels_key]
        return None

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._batches = []

    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if dataloader_idx != 0:
            return
        found = self.extract(outputs, batch)
        if found is None:
            raise RuntimeError(
                f"CalibrationCallback found no validation logits: validation_step returned "
                f"{type(outputs).__name__}. Return them with the labels, e.g. "
                f"`return {{'{self.logits_key}': logits, '{self.labels_key}': y}}` (keys set by "
                f"logits_key / labels_key), or subclass CalibrationCallback and override extract()."
            )
        if not trainer.sanity_checking:
            outputs, labels = found
            self._batches.append((outputs.detach(), labels.detach()))

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not self._batches:
            return
        scores, labels = self._gather()
        self._batches = []
        values = self._metrics(scores, labels)
        for name, value in values.items():
            # Identical on every process; sync_dist averages identical values (exactly).
            pl_module.log(self.prefix + name, value, sync_dist=True)
        self.calibrator.fit(scores, labels, **self.fit_options)
        self._latest = scores, labels, values

    def _metrics(self, scores: Tensor, labels: Tensor) -> dict[str, float]:
        return calibration_metrics(
            scores, labels, self.calibrator, self.metrics, folds=self.folds, n_bins=self.n_bins, fit_options=self.fit_options
        )

    def _gather(self) -> tuple[Tensor, Tensor]:
        """This epoch's scores (N, K) and labels (N,); in a distributed run, those of all
        processes in rank order, so that every process fits the same head."""
        outputs = torch.cat([s for s, _ in self._batches])
        labels = torch.cat([y for _, y in self._batches])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            outputs = torch.cat(gather_all_tensors(outputs))  # pads and trims uneven sizes
            labels = torch.cat(gather_all_tensors(labels))
        return scores_from_outputs(outputs, self.output), labels

    # ------------------------------------------------------------------------------ the head
    def calibrated_model(self, model: nn.Module) -> CalibratedModel:
        """``CalibratedModel(model, head)``: the network with this callback's fitted head."""
        return CalibratedModel(model, self.calibrator, self.output)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer
        if self.attach and self._hook is None:
            self._hook = pl_module.register_forward_hook(self._calibrate_forward)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _calibrate_forward(self, module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
        trainer = self._trainer
        if trainer is None or not (trainer.testing or trainer.predicting) or not self.calibrator.is_fitted:
            return None
        self._calibrated_calls += 1
        return calibrate_output(self.calibrator.to(output.device), output, self.output)

    def _start_calibrated_run(self, what: str) -> None:
        self._calibrated_calls = 0
        if self.attach and not self.calibrator.is_fitted:
            warnings.warn(
                f"CalibrationCallback has no fitted head, so {what} outputs are not calibrated: fit "
                f"first, or pass ckpt_path= a checkpoint saved with this callback.",
                stacklevel=2,
            )

    def _end_calibrated_run(self, what: str) -> None:
        if self.attach and self.calibrator.is_fitted and self._calibrated_calls == 0:
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
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._latest is None:
            return
        scores, labels, before = self._latest
        calibrated = cross_validate(self.calibrator, scores, labels, folds=self.folds, **self.fit_options)
        self.report_ = {"before": before, "after": self._metrics(calibrated, labels)}
        flat = {f"{self.prefix}{when}/{name}": v for when, values in self.report_.items() for name, v in values.items()}
        for logger in trainer.loggers:
            logger.log_metrics(flat, step=trainer.global_step)

    def table(self) -> str:
        """The before/after metrics of the last fit as a text table."""
        if self.report_ is None:
            raise RuntimeError("no report yet: it is made at the end of trainer.fit, after a validation epoch.")
        before, after = self.report_["before"], self.report_["after"]
        lines = [f"{'metric':<8}{'before':>10}{'after':>10}"]
        lines += [f"{name.upper():<8}{before[name]:>10.4f}{after[name]:>10.4f}" for name in before]
        return "\n".join(lines)

    # ----------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"calibrator": self.calibrator.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.calibrator.load_state_dict(state_dict["calibrator"])
