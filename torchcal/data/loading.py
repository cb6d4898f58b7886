"""Read classifier scores and labels from files, and say how the scores were read.

Supported files:

- ``.npz``: scores under ``logits`` (or ``log_probs``), ``probs`` or ``llr``; labels under
  ``labels`` (or ``targets``). Of several score keys, the one ``input`` names is read, else
  ``logits``. A calibration split may sit next to them as ``logits_val`` /
  ``labels_val`` (read it with ``split="val"``).
- ``.npy``: the scores; the labels come from ``labels_path`` or from a sibling file found by
  name, the word ``logits``, ``scores`` or ``probs`` in it replaced by ``labels`` or ``targets``:
  ``x_logits.npy`` -> ``x_labels.npy`` or ``x_targets.npy``, ``scores.npy`` -> ``labels.npy`` or
  ``targets.npy`` (a name without those words takes no sibling).
- ``.pt`` / ``.pth``: a dict with the ``.npz`` keys (its calibration split too), a ``(scores, labels)`` pair, or a scores
  tensor with ``labels_path``. Loaded with ``weights_only=True``. Tensors may be sparse, still
  attached to autograd, or in half precision (bfloat16, float16: read as float32, their
  probabilities floored as what their zeros stand for, see below).
- ``.csv``: a header row, one column named ``label`` (or ``labels``, ``target``, ``y``); every
  other column is a class score, in order. A header of the column numbers ``0,1,...,K-1`` (pandas'
  for a frame without column names) is taken as such from K = 3; a first line ``0`` or ``0,1`` is
  as likely a row of scores, and is refused. A first column that is the row index pandas writes
  (``df.to_csv()``) is dropped, and the note says so: whole numbers under an empty header, an
  index-like one (``id``, ``index``, ... :data:`CSV_INDEX_NAMES`) or one ending in ``_id`` (also
  the index of a slice, of a shuffled frame, or of frames concatenated, which repeats values), or
  the row numbers 0..N-1 in order under any header (a named ``RangeIndex``; from 3 rows).
  Probabilities written with a fixed number of decimals (at most :data:`CSV_MAX_DECIMALS`:
  ``%.4f``, pandas' ``round(6)``, whose small values come as ``1.3e-05``, six decimals in all
  either way) have zeros that stand for anything below half their last
  digit: they are floored there (5e-5 for 4 decimals), not at :data:`PROBABILITY_FLOOR` (1e-20,
  46 nats a zero: a CIFAR-10 file written with 4 decimals scored 0.539 nats for 0.378), or lower
  where K such zeros would add more than :data:`SIMPLEX_TOLERANCE` to a row (at ``1e-3 / K``).
  So are half-precision probabilities, at half their smallest subnormal (2^-25 for float16).

Scores are read as logits in the wide sense (any unnormalised log-posteriors) unless the caller
says otherwise (``input="probs"`` / ``"log_probs"`` / ``"llr"``), the file says so (key ``probs`` /
``log_probs`` / ``llr``), or the rows are provably probabilities: every value in [0, 1] and every
row summing to one within :data:`SIMPLEX_TOLERANCE` (the one tolerance, whether detected or
requested; a bfloat16 tensor's rows, within its rounding; values up to 1e-5 outside [0, 1] count
as round-off and are clamped). Rows that lie in [0, 1] but do not sum to one so (e.g.
probabilities rounded to two decimals) stay logits, and the note says so; ``input="probs"``
renormalises rows that sum to one within :data:`ROUNDED_TOLERANCE` (or K half-units of the second
decimal, where more, up to 0.5).

A single score column is a binary task: probabilities of class 1, log-probabilities of class 1,
log-likelihood ratios (LLRs), or the posterior log-odds a sigmoid head outputs (its one logit,
``input="logits"``, read as the metrics read one column of logits). When the caller does not say
which, a column with a value above 1 or with values of both signs holds log-odds if the file
stores it under the key ``logits``, else LLRs (made posteriors with the labels' class
frequencies, or ``priors``); a column in [0, 1], or with every value <= 0 (a log-probability, or
an LLR), is ambiguous and the caller must choose. :attr:`Scores.read_as` records what was assumed.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import warnings
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch
from torch import Tensor

from torchcal._validation import (
    PROBABILITY_FLOOR,
    _describe_nonfinite,
    as_tensor,
    binary_probability_columns,
    check_logits,
    check_logits_and_labels,
    check_priors,
    floored_log,
    probability_floor,
)
from torchcal.functional.scoring import class_frequencies

__all__ = [
    "EXAMPLE_PATH",
    "PROBABILITY_FLOOR",
    "ROUNDED_TOLERANCE",
    "SIMPLEX_TOLERANCE",
    "Scores",
    "binary_scores_to_logits",
    "has_split",
    "load_scores",
]

InputKind = Literal["auto", "logits", "probs", "log_probs", "llr"]

#: Rows in [0, 1] summing to one within this are probabilities, detected or requested: a CSV of
#: probabilities written with 4 decimals is off by up to K * 5e-5, within this up to K = 20.
SIMPLEX_TOLERANCE = 1e-3

#: Rows in [0, 1] summing to one only within this, or within K times half a unit of the second
#: decimal where that is more, up to 0.5 (probabilities rounded to two decimals at K = 100), look like
#: rounded probabilities: ``input="probs"`` renormalises them, and beyond it they are refused as
#: probabilities. Detection reads any rows in [0, 1] that do not sum to one within
#: SIMPLEX_TOLERANCE as logits, and the note says so.
ROUNDED_TOLERANCE = 0.05

#: Probabilities may stray this far outside [0, 1] by round-off (a last class computed as
#: ``1 - sum(others)`` in float32: -2.4e-7); they are clamped into it.
_UNIT_SLACK = 1e-5

#: The bundled real example (ResNet-110 CIFAR-10 logits, MIT; see ``examples/README.md``), with a
#: ``val`` calibration split: ``load_scores(EXAMPLE_PATH, split="val")``.
EXAMPLE_PATH = Path(__file__).with_name("examples") / "cifar10_resnet110_kangsepp.npz"

_SCORE_KEYS: dict[str, InputKind] = {"logits": "logits", "log_probs": "log_probs", "probs": "probs", "llr": "llr"}
_LABEL_KEYS = ("labels", "targets")
_CSV_LABEL_COLUMNS = ("label", "labels", "target", "targets", "y")


@dataclass(frozen=True)
class Scores:
    """Scores and labels read from a file.

    Attributes:
        logits: (N, K) float scores, logits in the wide sense (``softmax`` gives the posteriors).
        labels: (N,) int64 class indices in [0, K); ``None`` only when loaded with
            ``require_labels=False`` from a file without labels.
        read_as: one sentence saying how the file's scores were interpreted.
        source: where the data came from.
        llr_priors: (2,) the priors that turned binary LLRs into these posteriors (``logits[:, 1] -
            logits[:, 0]`` is the LLR plus their log-odds): uniform for one column of log-odds,
            which are LLRs under uniform priors; None for other scores.
            Scores of the same system read later (new data, unlabelled targets) need the same.
    """

    logits: Tensor
    labels: Tensor | None
    read_as: str
    source: str
    llr_priors: Tensor | None = None

    @property
    def num_samples(self) -> int:
        return self.logits.shape[0]

    @property
    def num_classes(self) -> int:
        return self.logits.shape[1]

    def with_llr_priors(self, priors: Any) -> Scores:
        """These scores as ``load_scores(..., priors=priors)`` reads them: binary LLRs turned into
        posteriors by ``priors`` (Bayes' rule) instead of ``llr_priors``; other scores (a sigmoid
        head's log-odds, which are posteriors already, among them) as they are."""
        if self.llr_priors is None or not self.read_as.startswith(_LLR_READ_AS):
            return self
        priors = check_priors(priors, 2)
        old = self.llr_priors.to(priors)
        if torch.equal(priors, old):
            return self
        llr = self.logits[:, 1].double() - self.logits[:, 0].double() - (old[1] / old[0]).log()
        start = self.read_as.index(_LLR_POSTERIORS)
        rest = self.read_as.find(";", start)  # (notes after the priors' name: the labels file, say)
        read_as = (self.read_as[:start] + f"{_LLR_POSTERIORS}the given priors ({priors[0]:.4g}, {priors[1]:.4g})"
                   + ("" if rest < 0 else self.read_as[rest:]))
        return dataclasses.replace(self, logits=binary_scores_to_logits(llr, "llr", priors), read_as=read_as, llr_priors=priors)


def binary_scores_to_logits(
    scores: Any, kind: Literal["probability", "llr"] = "probability", priors: Any = None
) -> Tensor:
    """Turn one score column of a binary task into two logit columns (class 0, class 1).

    Args:
        scores: (N,) or (N, 1) probabilities of class 1 (``kind="probability"``) or
            log-likelihood ratios ``log p(x|1) / p(x|0)`` (``kind="llr"``; log posterior odds are
            the LLR under uniform priors).
        kind: what the column holds.
        priors: optional (2,) class priors; an LLR becomes a posterior only given priors (Bayes'
            rule, Ferrer eq. 46), uniform when omitted. Not used for probabilities.

    Returns:
        (N, 2) logits in float64, with ``softmax(logits)[:, 1]`` the posterior of class 1.
        Probabilities of 0 or 1 are floored at :data:`PROBABILITY_FLOOR` so the logits are finite.

    Example:
        >>> import torch
        >>> binary_scores_to_logits(torch.tensor([0.25, 0.5])).softmax(1)[:, 1].tolist()
        [0.25, 0.5]
        >>> binary_scores_to_logits(torch.tensor([0.0]), kind="llr", priors=[0.9, 0.1]).softmax(1)
        tensor([[0.9000, 0.1000]], dtype=torch.float64)
    """
    given = as_tensor(scores, "scores")
    scores = given.to(torch.float64)
    if scores.ndim == 2 and scores.shape[1] == 1:
        scores = scores[:, 0]
    if scores.ndim != 1:
        raise ValueError(f"a binary score column must have shape (N,) or (N, 1), got {tuple(scores.shape)}.")
    if kind == "probability":
        if scores.isnan().any():
            raise ValueError(f"probabilities must be numbers in [0, 1]; found {_describe_nonfinite(scores)}. Drop or replace those samples.")
        if bool(((scores < 0) | (scores > 1)).any()):
            raise ValueError("probabilities must lie in [0, 1]; found values outside. Are these LLRs?")
        return floored_log(binary_probability_columns(scores, given.dtype))
    if kind == "llr":
        if not bool(torch.isfinite(scores).all()):
            raise ValueError(f"LLRs must be finite; found {_describe_nonfinite(scores)}. Drop or replace those samples.")
        log_priors = torch.zeros(2, dtype=torch.float64) if priors is None else check_priors(priors, 2).log()
        return torch.stack([torch.zeros_like(scores), scores], dim=1) + log_priors
    raise ValueError(f"kind must be 'probability' or 'llr', got {kind!r}.")


def load_scores(
    path: str | Path,
    labels_path: str | Path | None = None,
    input: InputKind = "auto",
    split: Literal["test", "val"] = "test",
    priors: Any = None,
    require_labels: bool = True,
    labels_option: str = "--labels",
    fallback: InputKind | None = None,
) -> Scores:
    """Load and validate scores and labels from ``path`` (formats in the module docstring).

    Args:
        path: the scores file.
        labels_path: a separate labels file (``.npy``, ``.pt`` or one-column ``.csv``/``.txt``).
        input: ``"logits"`` (rows of logits, or one column of posterior log-odds of class 1),
            ``"probs"`` (rows of probabilities, or one column of probabilities of class 1),
            ``"log_probs"`` (rows of log-probabilities, or one column of log-probabilities of
            class 1), ``"llr"`` (one column of log-likelihood ratios) or ``"auto"``.
        split: ``"val"`` reads the ``logits_val``/``labels_val`` split of an ``.npz`` or a ``.pt`` dict.
        priors: (2,) priors used only to turn binary LLRs into posteriors; None: the labels'
            class frequencies (the priors every metric assumes when given none), or uniform priors
            for a file without labels or with a class absent.
        require_labels: with ``False``, scores without labels load with ``labels=None``
            (for applying a fitted calibrator).
        labels_option: the command-line option that gives ``labels_path``, named in messages.
        fallback: with ``input="auto"``, how to read scores whose file does not say what they are
            (no key, or ``logits`` over rows, which detection still reads) where their values
            allow it (probabilities in [0, 1], log-probabilities <= 0, LLRs in one column): a
            calibrator's saved reading. A key that names the kind (``probs``, ``llr``) wins.

    Raises:
        FileNotFoundError: no such file. ValueError: anything wrong with the content, with a
        message that names the file and the fix.

    Example:
        >>> s = load_scores("scores.npz")  # doctest: +SKIP
        >>> s.logits.shape, s.read_as      # doctest: +SKIP
        (torch.Size([10000, 10]), 'logits')
    """
    if input not in get_args(InputKind):
        raise ValueError(f"input must be one of {list(get_args(InputKind))} (as --input of the command line), got {input!r}.")
    if fallback is not None and fallback not in get_args(InputKind):
        raise ValueError(f"fallback must be None or one of {list(get_args(InputKind))}, got {fallback!r}.")
    if split not in ("test", "val"):
        raise ValueError(f"split must be 'test' or 'val', got {split!r}.")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    where = str(path) if split == "test" else f"{path} ({split} split: logits_{split}, labels_{split})"
    sibling = _sibling_labels(path)[0] if labels_path is None and path.suffix.lower() == ".npy" else None
    if sibling is not None:  # (a file the caller never named: its errors say which)
        where += f" (labels: {sibling.name}, found beside it)"
    try:
        raw, labels, hint, missing, note, unit = _read(path, labels_path, split, input, labels_option)
        labels = None if labels is None else _as_labels(labels)
        reason = "as requested" if input != "auto" else "as the file's key says"
        kind = input if input != "auto" else hint
        tolerance = _simplex_tolerance(raw)
        stored = _stored_half_precision(raw)  # (before _as_array widens it)
        raw = _as_array(raw, "scores")
        if input == "auto" and fallback is not None and hint in ("auto", _AUTO_LOGITS) and _values_allow(raw, fallback):
            kind, reason = fallback, f"as the calibrator's were: --input {fallback}, saved with it"
        logits, read_as, llr_priors = _to_logits(raw, kind, reason, priors, labels, tolerance, stored, unit)
        read_as += note
        if labels is not None and labels_path is not None and len(labels) == len(logits) + 1 and _header_zero(Path(labels_path)):
            raise ValueError(f"the labels file {Path(labels_path).name} has one entry more than the scores have rows, and its "
                             f"first line is '0': the header pandas writes for an unnamed Series (Series.to_csv(index=False))? "
                             f"Drop that line, or name the column: .to_csv(index=False, header=['label']).")
        if labels is not None:
            logits, labels = check_logits_and_labels(logits, labels, warn_probs=False)  # read_as says
        elif require_labels:
            raise ValueError(missing)
        else:
            logits = check_logits(logits, warn_probs=False)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    except MemoryError as err:  # a format whose size cannot be checked before reading
        raise ValueError(f"{where}: too large to load into memory ({err}).") from None
    source = str(path) if split == "test" else f"{path} ({split} split)"
    return Scores(logits=logits, labels=labels, read_as=read_as, source=source, llr_priors=llr_priors)


#: The files that can store a calibration split (a ``.pt`` / ``.pth`` one as a dict).
_SPLIT_SUFFIXES = (".npz", ".pt", ".pth")


def has_split(path: str | Path, split: Literal["val"] = "val") -> bool:
    """Whether the ``.npz`` (or the ``.pt`` / ``.pth`` dict) at ``path`` stores a
    ``logits_val``/``labels_val`` calibration split (not a file that cannot be read:
    :func:`load_scores` says what is wrong with it).

    Raises:
        ValueError: the file stores half a split, its scores without its labels or the reverse.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in _SPLIT_SUFFIXES or not path.is_file():
        return False
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as f:
                files = f.files
        else:
            obj = _torch_load(path, mmap=True)  # (the keys: the tensors are mapped, not read)
            files = list(obj) if isinstance(obj, dict) else []
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return False
    scores = next((f"{k}_{split}" for k in _SCORE_KEYS if f"{k}_{split}" in files), None)
    labels = next((f"{k}_{split}" for k in _LABEL_KEYS if f"{k}_{split}" in files), None)
    if (scores is None) != (labels is None):  # else the half that is there would be dropped silently
        missing = " or ".join(repr(f"{k}_{split}") for k in (_LABEL_KEYS if labels is None else _SCORE_KEYS))
        raise ValueError(f"{path}: has {scores or labels!r} but no {missing}; a '{split}' split needs its scores "
                         f"and its labels (or neither).")
    return scores is not None


# --- reading files -------------------------------------------------------------------------------

def _pass_labels(option: str) -> str:
    return f"pass the labels file explicitly (labels_path=..., or {option} on the command line)"


def _two_labels(own: str, option: str) -> str:
    return f"the file has its own labels ({own}), and a labels file was given too (labels_path, {option}): drop one of them."


def _read(
    path: Path, labels_path: str | Path | None, split: str, input: InputKind, labels_option: str
) -> tuple[Any, Any, str, str, str, float | None]:
    """Return ``(scores, labels or None, kind hint (an input kind, or :data:`_AUTO_LOGITS`), what
    to say if labels are missing, a note on what was left out of the file, the unit of the last
    decimal a CSV's numbers were written to (None: not rounded so, or not a CSV))``; of a file with
    several score keys, the one ``input`` names.
    Messages name ``labels_option`` as the way to give a labels file."""
    suffix = path.suffix.lower()
    if split != "test" and suffix not in _SPLIT_SUFFIXES:
        raise ValueError(f"only .npz files and .pt/.pth dicts store a '{split}' split.")
    key_suffix = "" if split == "test" else f"_{split}"
    given = None if labels_path is None else _load_labels(labels_path)
    if suffix == ".npz":
        try:
            npz = np.load(path, allow_pickle=False)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
            raise _unreadable(".npz", err) from None
        with npz:
            return (*_from_mapping(_UsedArrays(npz), given, input, labels_option, suffix=key_suffix), "", None)
    if suffix in (".pt", ".pth"):
        return (*_from_torch(path, given, input, labels_option, key_suffix), "", None)
    if suffix == ".npy":
        sibling, looked_for = _sibling_labels(path)
        labels = given if given is not None or sibling is None else _load_labels(sibling)
        missing = f"no labels file found next to it (looked for {looked_for}); {_pass_labels(labels_option)}."
        note = "" if given is not None or sibling is None else f"; labels from {sibling.name}"
        return _load_array(path), labels, "auto", missing, note, None
    if suffix == ".csv":
        scores, labels, note, unit = _read_csv(path)
        if labels is not None and given is not None:
            raise ValueError(_two_labels("its 'label' column", labels_option))
        missing = f"no 'label' column; add one or {_pass_labels(labels_option)}."
        return scores, given if labels is None else labels, "auto", missing, note, unit
    raise ValueError(f"unsupported file type {path.suffix!r}; use .npz, .npy, .pt/.pth or .csv.")


def _unreadable(kind: str, err: Exception) -> ValueError:
    """NumPy's reason, but not its advice to load pickles (``allow_pickle``), which is what it says
    of any file that is no NumPy file at all."""
    reason = str(err) or type(err).__name__
    if "allow_pickle" in reason:
        reason = "it is no NumPy file, or it holds pickled Python objects, which torchcal does not load"
    return ValueError(f"not a readable {kind} file ({reason}).")


class _UsedArrays(Mapping):
    """The arrays of an open ``.npz`` file, each size-checked and read only when used: other
    members (features, an object array of metadata) are neither read nor held against the memory."""

    def __init__(self, npz: Any) -> None:
        self._npz = npz

    def __getitem__(self, key: str) -> np.ndarray:
        try:
            with self._npz.zip.open(key + ".npy") as stream:
                _check_size(stream, f"the array {key!r}")
            return self._npz[key]
        except _TooLarge:
            raise
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
            raise _unreadable(".npz", err) from None

    def __contains__(self, key: object) -> bool:
        return key in self._npz.files

    def __iter__(self) -> Iterator[str]:
        return iter(self._npz.files)

    def __len__(self) -> int:
        return len(self._npz.files)


def _from_mapping(found: Mapping[str, Any], given: Any, input: InputKind, labels_option: str, suffix: str = ""):
    score_keys = [k for k in _SCORE_KEYS if k + suffix in found]
    if not score_keys:
        raise ValueError(
            f"no scores found: expected a key {' or '.join(repr(k + suffix) for k in _SCORE_KEYS)}, "
            f"found keys {sorted(found)}."
        )
    # the key the declared input names; else "logits" wins over "probs" when both are stored
    key = input if input in score_keys else score_keys[0]
    scores = found[key + suffix]  # (first: a file too large is refused before anything else is said of it)
    label_keys = [k + suffix for k in _LABEL_KEYS if k + suffix in found]
    if label_keys and given is not None:
        raise ValueError(_two_labels(repr(label_keys[0]), labels_option))
    labels = found[label_keys[0]] if label_keys else given
    kind: str = _SCORE_KEYS[key]
    shape = tuple(getattr(scores, "shape", ()))  # (a list, ragged or not, is read and checked later)
    columns = shape[1] if len(shape) == 2 else None
    if kind == "logits" or (kind == "log_probs" and columns is not None and columns > 1):
        # rows of log-posteriors are logits, detection still catching stored probabilities; one
        # column under "logits" is a sigmoid head's log-odds, unless its values say otherwise
        kind = _AUTO_LOGITS if len(shape) == 1 or columns == 1 else "auto"
    missing = f"no labels found: expected a key 'labels{suffix}', found keys {sorted(found)}."
    return scores, labels, kind, missing


def _torch_load(path: Path, mmap: bool = False) -> Any:
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol of a bad file
            warnings.simplefilter("ignore")
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError:
                if not mmap:
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)  # (a legacy file: not mappable)
    except Exception as err:  # torch raises many exception types for a bad file
        if "Weights only load failed" in str(err):  # (objects other than tensors: not unpickled, it is unsafe)
            raise ValueError("not a readable torch file of tensors: torchcal unpickles nothing else (e.g. NumPy arrays: "
                             "unpickling could run code); save tensors (torch.from_numpy), or use .npz.") from None
        first_line = (str(err).strip().splitlines() or [""])[0]  # some span many lines
        raise ValueError(f"not a readable torch file ({type(err).__name__}: {first_line}).") from None


def _from_torch(path: Path, given: Any, input: InputKind, labels_option: str, suffix: str = ""):
    obj = _torch_load(path)
    if isinstance(obj, dict):
        return _from_mapping(obj, given, input, labels_option, suffix=suffix)
    if suffix:
        raise ValueError(f"a '{suffix[1:]}' split is stored in a dict (keys 'logits{suffix}', 'labels{suffix}'); "
                         f"the file holds a {type(obj).__name__}.")
    if isinstance(obj, (tuple, list)) and len(obj) == 2:
        if given is not None:
            raise ValueError(_two_labels("a (scores, labels) pair", labels_option))
        return obj[0], obj[1], "auto", ""
    if isinstance(obj, Tensor):
        return obj, given, "auto", f"the file holds scores only; {_pass_labels(labels_option)}."
    raise ValueError(f"expected a dict, a (scores, labels) pair or a tensor, got {type(obj).__name__}.")


def _load_array(path: Path) -> np.ndarray:
    with path.open("rb") as stream:
        _check_size(stream, "the array")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise _unreadable(".npy", err) from None


#: Scores are loaded only if the array, plus two float64 working copies of it, fits in the
#: memory available; larger files are refused before they are read.
WORKING_COPIES = 2


def _available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _size(num_bytes: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.3g} {unit}"
        num_bytes /= 1024
    raise AssertionError  # unreachable


class _TooLarge(ValueError):
    """An array that would not fit in memory."""


def _check_size(stream: Any, what: str) -> None:
    """Refuse an ``.npy`` array too large for the memory, from its header alone.

    Leaves ``stream`` wherever the header ends; a stream that is not an ``.npy`` header, or whose
    header cannot be read, is left to the loader to report.
    """
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    try:
        shape, _, dtype = readers[np.lib.format.read_magic(stream)](stream)
    except (KeyError, ValueError, OSError, EOFError):
        return
    count = math.prod(shape)
    stored = count * dtype.itemsize
    needed = stored + WORKING_COPIES * 8 * count
    available = _available_memory()
    if available is not None and needed > available:
        raise _TooLarge(
            f"{what} of shape {shape} ({_size(stored)} of {dtype}) is too large: evaluating it needs about "
            f"{_size(needed)} of memory and {_size(available)} is available. Evaluate a subset, or stream "
            f"it through the torchcal.metrics classes in batches."
        )


def _load_labels(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such labels file: {path}")
    suffix = path.suffix.lower()
    if suffix in (".npy", ".pt", ".pth"):
        try:
            labels = _load_array(path) if suffix == ".npy" else _torch_load(path)
        except ValueError as err:
            raise ValueError(f"labels file {path}: {err}") from None
        if isinstance(labels, Mapping):  # (a dict saved with torch.save: its labels under the key the scores files use)
            key = next((k for k in _LABEL_KEYS if k in labels), None)
            if key is None:
                raise ValueError(f"labels file {path}: a dict without a key {' or '.join(map(repr, _LABEL_KEYS))}; "
                                 f"found keys {sorted(map(str, labels))}.")
            labels = labels[key]
        return labels
    if suffix == ".csv":
        return _labels_csv(path)
    if suffix == ".txt":
        try:
            return np.loadtxt(path, ndmin=1, encoding="utf-8-sig")  # (as the CSVs: a byte-order mark is no label)
        except ValueError as err:
            raise ValueError(f"{path}: labels must be one number per line ({err}).") from None
    raise ValueError(f"unsupported labels file type {path.suffix!r}; use .npy, .pt, .csv or .txt.")


def _header_zero(path: Path) -> bool:
    """Whether a ``.csv`` / ``.txt`` labels file's first line is a lone ``0``."""
    if path.suffix.lower() not in (".csv", ".txt"):
        return False
    with path.open(encoding="utf-8-sig") as f:
        return f.readline().strip() == "0"


def _labels_csv(path: Path) -> np.ndarray:
    """A labels CSV: one number per line, or under a header (as ``pandas.Series.to_csv`` writes it)
    the column named ``label`` (or another of :data:`_CSV_LABEL_COLUMNS`), the only column, or
    the one beside a row index."""
    with path.open(newline="", encoding="utf-8-sig") as f:
        rows = [row for row in csv.reader(f) if row]
    column = 0
    if rows and all(_is_number(cell) for cell in rows[0]):  # no header: one label per line, or an index and the labels
        widths = {len(row) for row in rows}
        if widths == {2} and all(_is_number(row[0]) and float(row[0]) == i for i, row in enumerate(rows)):
            column = 1  # (pandas' Series.to_csv(header=False): the row numbers 0..N-1, then the labels)
        elif widths != {1}:
            raise ValueError(f"{path}: a labels CSV without a header needs one number per line, got rows of "
                             f"{sorted(widths)} columns; name the label column 'label' in a header row.")
    elif rows:
        header = [name.strip().lower() for name in rows.pop(0)]
        named = [i for i, name in enumerate(header) if name in _CSV_LABEL_COLUMNS]
        if len(named) == 1:
            column = named[0]
        elif len(header) == 2 and (header[0] in CSV_INDEX_NAMES or header[0].endswith("_id")):
            column = 1
        elif len(header) != 1:
            raise ValueError(f"{path}: a labels CSV with a header needs one column named 'label' (or one column only), "
                             f"got columns {header}.")
    try:
        return np.array([float(row[column]) for row in rows], dtype=np.float64)
    except (ValueError, IndexError) as err:
        raise ValueError(f"{path}: labels must be one number per line, or a 'label' column under a header ({err}).") from None


def _sibling_labels(path: Path) -> tuple[Path | None, str]:
    """The labels file that goes with a ``.npy`` scores file, found by name, and the names tried."""
    stem = path.stem
    candidates = [path.with_name(stem.replace(word, labels) + ".npy")
                  for word in ("logits", "scores", "probs") if word in stem for labels in ("labels", "targets")]
    found = next((c for c in candidates if c != path and c.is_file()), None)
    return found, ", ".join(c.name for c in candidates) or "a name with 'logits', 'scores' or 'probs' in it"


#: Reading a CSV file holds a line of text at a time and the numbers as float64 blocks, which are
#: then joined, their score columns taken and made float32: about this many bytes per byte of text
#: at most (5,000 x 1,000 written with ``%.4f``, 7 characters a cell: 4.0x; ``%.7g``: 2.9x; when
#: every cell was a Python string first, 17.4x and 12.6x).
CSV_EXPANSION = 5

#: Rows parsed into one float64 block of the table.
_CSV_BLOCK_ROWS = 4096

#: A CSV whose numbers (of its first :data:`_CSV_RESOLUTION_ROWS` rows) are written with at most
#: this many decimals (an exponent of -4 or below counted in: ``1.3e-05`` has six) was
#: rounded to them (see the module docstring); Python's and NumPy's shortest round-trip text of
#: float32 or float64 values has more, and ``%e`` formatting writes the exponents of larger numbers too.
CSV_MAX_DECIMALS = 8
_CSV_RESOLUTION_ROWS = 100

#: Headers of a first CSV column that, over whole numbers, name a row index, not a class (so does
#: any header ending in "_id"; compared in lower case; "unnamed: 0" is how pandas reads back an
#: index it wrote without a name).
CSV_INDEX_NAMES = ("", "id", "ids", "idx", "index", "row", "sample", "sample_id", "unnamed: 0")


def _read_csv(path: Path) -> tuple[np.ndarray, np.ndarray | None, str, float | None]:
    """The scores (N, K) and labels (N,) or None of a CSV file, a note on what was left out of it,
    and the unit of the last decimal its numbers were rounded to (:data:`CSV_MAX_DECIMALS`)."""
    size, available = path.stat().st_size, _available_memory()
    if available is not None and CSV_EXPANSION * size > available:
        raise _TooLarge(
            f"the CSV file ({_size(size)}) is too large: reading it needs about {_size(CSV_EXPANSION * size)} "
            f"of memory and {_size(available)} is available. Save the scores with numpy.save (.npy, read "
            f"without that overhead), or evaluate a subset."
        )
    with path.open(newline="", encoding="utf-8-sig") as f:  # (Excel's "CSV UTF-8" starts with a byte-order mark)
        reader = csv.reader(f)
        skipped = 0  # (blank lines before the header)
        for row in reader:
            if any(cell.strip() for cell in row):
                header = [name.strip() for name in row]
                break
            skipped += 1
        else:
            raise ValueError("the CSV file is empty.")
        separator = next((sep for sep in (";", "\t") if len(header) == 1 and sep in header[0]), None)
        if separator is not None:
            raise ValueError(f"the CSV file's columns seem to be separated by {separator!r}: torchcal reads comma-separated "
                             f"values with '.' as the decimal point (pandas: to_csv(sep=',', decimal='.')).")
        # A header of the column numbers 0..K-1 is pandas' for a frame without column names; from 3
        # columns (a first row 0, 1 of two columns is as likely a row of probabilities), and said so.
        numbered = header == [str(i) for i in range(len(header))]
        if numbered and len(header) < 3:
            raise ValueError(f"the first line, {','.join(header)!r}, may be pandas' column numbers or a row of scores: name "
                             f"the columns in a header row (e.g. c0,c1, and 'label' for the labels' column).")
        if all(_is_number(cell) for cell in header) and not numbered:
            raise ValueError("a CSV file needs a header row naming its columns (and a column 'label', unless a labels file "
                             "gives the labels).")
        label_cols = [i for i, name in enumerate(header) if name.lower() in _CSV_LABEL_COLUMNS]
        if len(label_cols) > 1:  # (the second would be read as a class's scores)
            names = ", ".join(repr(header[i]) for i in label_cols)
            raise ValueError(f"the CSV file has {len(label_cols)} label columns ({names}); keep the one with the labels.")
        blocks: list[np.ndarray] = []
        block, filled = np.empty((_CSV_BLOCK_ROWS, len(header))), 0
        decimals = 0  # the most of the first rows' numbers (above CSV_MAX_DECIMALS: not rounded so)
        for line, row in enumerate(reader, start=2 + skipped):
            if not any(cell.strip() for cell in row):
                continue  # (blank lines: none)
            if len(row) != len(header):  # (a ragged table would fail the parsing with a misleading message)
                why = ("is the file truncated?" if len(row) < len(header) else
                       "a trailing comma?" if row[-1].strip() == "" else "a column without a name in the header?")
                raise ValueError(f"every CSV row must have {len(header)} cells, like the header; line {line} has {len(row)} ({why}).")
            try:
                block[filled] = [float(cell) for cell in row]
            except ValueError:
                column, cell = next((column, cell) for column, cell in enumerate(row) if not _is_number(cell))
                raise ValueError(f"every CSV cell after the header must be a number; line {line}, column {header[column]!r} "
                                 f"holds {cell!r}.") from None
            if decimals <= CSV_MAX_DECIMALS and len(blocks) * _CSV_BLOCK_ROWS + filled < _CSV_RESOLUTION_ROWS:
                decimals = max(decimals, *(_decimals(cell) for cell in row))
            filled += 1
            if filled == _CSV_BLOCK_ROWS:
                blocks.append(block)
                block, filled = np.empty_like(block), 0
    blocks.append(block[:filled])
    table = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
    del blocks, block
    if not table.shape[0]:
        raise ValueError("the CSV file has a header but no rows of scores.")
    index = None if label_cols[:1] == [0] else _row_index(header[0], table[:, 0])
    note = f"; the first column ({index}) is a row index as pandas writes it, left out" if index else ""
    if numbered:
        note += f"; its line {1 + skipped}, the column numbers 0..{len(header) - 1}, read as the header"
    score_cols = [i for i in range(int(index is not None), len(header)) if not (label_cols and i == label_cols[0])]
    unit = None if decimals == 0 or decimals > CSV_MAX_DECIMALS else 10.0**-decimals
    return table[:, score_cols], table[:, label_cols[0]] if label_cols else None, note, unit


def _decimals(cell: str) -> int:
    """The decimals a CSV number is written with, an exponent of -4 or below counted in
    (``1.3e-05``: six; Python and pandas write numbers below 1e-4 so, R's ``write.csv`` 0.0001 as
    ``1e-04``); more than :data:`CSV_MAX_DECIMALS` for inf, nan or any other exponent
    (``5.00e-01``: ``%e`` formatting, significant digits rather than decimals)."""
    text = cell.strip().lower()
    if "n" in text:  # (inf, nan)
        return CSV_MAX_DECIMALS + 1
    mantissa, _, exponent = text.partition("e")
    point = mantissa.find(".")
    places = 0 if point < 0 else len(mantissa) - point - 1
    if not exponent:
        return places
    return places - int(exponent) if int(exponent) <= -4 else CSV_MAX_DECIMALS + 1


def _row_index(name: str, values: np.ndarray) -> str | None:
    """Why the first CSV column, headed ``name``, is a row index rather than class scores (see the
    module docstring), or None if it is not one."""
    if not bool((values == np.round(values)).all()):
        return None
    if name.lower() in CSV_INDEX_NAMES or name.lower().endswith("_id"):  # (never a class's name)
        return f"{f'{name!r}' if name else 'no name'}, whole numbers"
    # (from 3 rows: one row's 0, or two rows' 0, 1, are as likely a class's scores)
    if values.size >= 3 and np.array_equal(values, np.arange(values.size)):
        return f"{name!r}, the row numbers 0..N-1"
    return None


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


# --- interpreting the content --------------------------------------------------------------------

def _as_array(values: Any, what: str) -> np.ndarray:
    """``values`` as a NumPy array. A tensor is detached from autograd (a model output saved without
    ``.detach()``), made dense, dequantised, and widened to float32 from a floating dtype that NumPy
    lacks or that is too coarse to compute in (bfloat16, float16, float8): what the scores go
    through next would do the same."""
    try:
        if isinstance(values, Tensor):
            values = values.detach()
            values = values.dequantize() if values.is_quantized else values
            values = values.to_dense() if values.layout != torch.strided else values
            if values.is_floating_point() and values.dtype not in (torch.float32, torch.float64):
                values = values.float()
        return np.asarray(values)
    except (RuntimeError, TypeError, ValueError) as err:  # torch and NumPy raise any of these
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"the {what} cannot be read as an array of numbers ({first_line}); save them as one "
                         f"array or dense tensor of numbers.") from None


def _as_labels(labels: Any) -> Tensor:
    """Class indices as int64 (N,): accepts (N, 1), bool, unsigned and whole-number floats."""
    labels = _as_array(labels, "labels")
    if labels.dtype.kind not in "biuf":
        example = f" such as {str(labels.flat[0])!r}" if labels.size else ""
        raise ValueError(f"labels must be class indices 0..K-1, got values of dtype {labels.dtype}{example}; "
                         f"map the class names to integers first.")
    labels = as_tensor(labels, "labels")
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if torch.is_floating_point(labels):
        if not bool(torch.isfinite(labels).all()):
            raise ValueError("labels contain NaN or infinite values.")
        if not bool((labels == labels.round()).all()):
            raise ValueError("labels must be whole numbers (class indices 0..K-1).")
        largest = float(labels.flatten()[labels.abs().argmax()]) if labels.numel() else 0.0
        if abs(largest) >= 2.0**62:  # (.long() would wrap it, and the range check name the wrapped value)
            raise ValueError(f"labels must be class indices 0..K-1; found {largest:.6g}.")
    return labels.long()


def _to_logits(
    scores: np.ndarray, kind: str, reason: str, priors: Any, labels: Tensor | None, tolerance: float = SIMPLEX_TOLERANCE,
    stored: torch.dtype | None = None, unit: float | None = None,
) -> tuple[Tensor, str, Tensor | None]:
    """Interpret ``scores`` as ``kind`` (or detect it for ``"auto"``; rows of probabilities sum to 1
    within ``tolerance``); return logits, a note and the priors that turned LLRs into them (see
    :func:`load_scores`; None for other kinds). ``stored``: the half precision the scores were
    saved in before they were widened; ``unit``: that of the last decimal a CSV's numbers were
    rounded to. A probability of 0 stands for anything below what either leaves, and is floored there."""
    if scores.dtype.kind not in "fiub" or scores.ndim not in (1, 2) or scores.size == 0:
        raise ValueError(f"scores must be a non-empty (N, K) or (N,) array of numbers, got shape "
                         f"{scores.shape} and dtype {scores.dtype}.")
    # (in native byte order: torch reads no other, and a big-endian .npy raised its internal message;
    # a float torch has no type for, NumPy's longdouble, as float64)
    wider = scores.dtype.kind == "f" and scores.dtype.itemsize > 8
    scores = np.ascontiguousarray(scores, dtype=np.float64 if wider else scores.dtype.newbyteorder("="))
    dtype = torch.float64 if scores.dtype == np.float64 else torch.float32
    if stored is None:
        stored = torch.float16 if scores.dtype == np.float16 else dtype  # (whose probabilities of 0 stand for < 2^-25)
    # a rounded CSV's zeros: below half a unit of the last digit, and not so high that a row's
    # zeros add more than SIMPLEX_TOLERANCE to its sum (K = 100 written with 4 decimals: 1e-5)
    columns = 2 if scores.ndim == 1 or scores.shape[1] == 1 else scores.shape[1]
    floor = max(probability_floor(stored), 0.0 if unit is None else min(unit / 2, SIMPLEX_TOLERANCE / columns))
    values = torch.from_numpy(scores).to(dtype)
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"scores contain {int((~torch.isfinite(values)).sum())} NaN or infinite values.")
    if values.ndim == 1 or values.shape[1] == 1:
        return _one_column_to_logits(values.reshape(-1), kind, reason, priors, labels, stored, floor)
    return (*_columns_to_logits(values, kind, reason, tolerance, floor), None)


def _stored_half_precision(scores: Any) -> torch.dtype | None:
    """The half precision (bfloat16, float16) of a tensor that :func:`_as_array` widens to float32."""
    if isinstance(scores, Tensor) and scores.dtype in (torch.float16, torch.bfloat16):
        return scores.dtype
    return None


def _simplex_tolerance(scores: Any) -> float:
    """SIMPLEX_TOLERANCE, or a tensor's precision where that is coarser: bfloat16 rounds a row's
    sum by up to 2^-8 (probabilities saved so were read as logits: NLL 1.55 for 0.38)."""
    if isinstance(scores, Tensor) and scores.is_floating_point():
        return max(SIMPLEX_TOLERANCE, torch.finfo(scores.dtype).eps)
    return SIMPLEX_TOLERANCE


def _values_allow(scores: np.ndarray, kind: str) -> bool:
    """Whether ``scores`` can be of ``kind`` (an input kind): probabilities in [0, 1] (up to
    round-off), log-probabilities at most 0, LLRs in one column; anything can be logits."""
    if scores.dtype.kind not in "fiub" or scores.size == 0:
        return True  # (the reading's own checks name what is wrong)
    if kind == "probs":
        return bool(np.all((scores >= -_UNIT_SLACK) & (scores <= 1 + _UNIT_SLACK)))
    if kind == "log_probs":
        return bool(np.all(scores <= _UNIT_SLACK))
    return kind != "llr" or scores.ndim == 1 or scores.shape[1] == 1


#: How ``read_as`` of binary LLRs begins, and how it goes on to name the priors that made them posteriors.
_LLR_READ_AS = "binary log-likelihood ratios"
_LLR_POSTERIORS = ", turned into posteriors with "

#: The kind hint of one score column stored under the key ``logits``: detected as ``"auto"`` is,
#: but where the values leave any reading open, posterior log-odds rather than LLRs.
_AUTO_LOGITS = "auto-logits"

_ONE_COLUMN_KINDS = {
    "probs": "probabilities of class 1 (input='probs', --input probs)",
    "log_probs": "log-probabilities of class 1 (input='log_probs', --input log_probs)",
    "llr": "LLRs (input='llr', --input llr)",
    "logits": "a sigmoid head's log-odds (input='logits', --input logits)",
}


def _one_column_to_logits(
    values: Tensor, kind: str, reason: str, priors: Any, labels: Tensor | None, stored: torch.dtype, floor: float
) -> tuple[Tensor, str, Tensor | None]:
    if kind in ("auto", _AUTO_LOGITS):
        under_logits = kind == _AUTO_LOGITS
        options: tuple[str, ...] = ()
        if _in_unit_interval(values):
            options = ("probs", "llr")
            found = "every value in [0, 1]"
        elif bool((values <= 0).all()):  # exp of every value is a probability
            options = ("log_probs", "llr")
            found = "every value <= 0"
        if options:
            choices = " or ".join(_ONE_COLUMN_KINDS[k] for k in options + (("logits",) if under_logits else ()))
            raise ValueError(f"one score column with {found}: say whether it holds {choices}.")
        # (deployment priors do not turn a sigmoid head's log-odds into LLRs: they are posteriors)
        kind = "logits" if under_logits else "llr"
        reason = ("one column under the key 'logits' with values above 1 or of both signs" if under_logits else
                  "one score column with values above 1 or of both signs") + ", so neither probabilities nor log-probabilities"
    if kind == "logits":  # a sigmoid head's one logit: the posterior log-odds, LLRs under uniform priors
        note = f"binary posterior log-odds of class 1, as a sigmoid head outputs ({reason})"
        uniform = torch.full((2,), 0.5, dtype=torch.float64)
        return binary_scores_to_logits(values, "llr", uniform), note, uniform
    if kind == "llr":
        if priors is not None:
            priors = check_priors(priors, 2)
            prior_note = f"the given priors ({priors[0]:.4g}, {priors[1]:.4g})"
        else:
            priors, prior_note = _label_frequencies(labels, values.shape[0])
        note = f"{_LLR_READ_AS} ({reason}){_LLR_POSTERIORS}{prior_note}"
        return binary_scores_to_logits(values, "llr", priors), note, priors
    if kind == "log_probs":
        if bool((values > 0).any()):
            raise ValueError("log-probabilities must be <= 0; found positive values. Are these LLRs?")
        values = values.to(torch.float64).exp()
    elif _in_unit_interval(values):  # (round-off outside [0, 1]: _UNIT_SLACK)
        values = values.clamp(0, 1)
    if kind != "probs":  # (a rounded CSV's floor is that of its probabilities' text, not of their logs':
        floor = probability_floor(values.dtype)  # these are exp'd in float64 and floored there)
    note = f"binary {'probabilities' if kind == 'probs' else 'log-probabilities'} of class 1 ({reason})"
    note += _floor_note(torch.stack([1 - values, values], 1), floor)
    if floor > probability_floor(stored):  # (a rounded CSV's: its 1 as its 0)
        values = values.clamp(floor, 1 - floor)
    given = values.to(stored) if kind == "probs" else values  # (exact: half precision's values, read into float32)
    return binary_scores_to_logits(given, "probability"), note, None


def _label_frequencies(labels: Tensor | None, num_samples: int) -> tuple[Tensor, str]:
    """The binary ``labels``' class frequencies and a note, or uniform priors where there are no
    labels to count (or they are not N binary labels with both classes: their checks say why)."""
    if labels is not None and labels.shape == (num_samples,) and bool(((labels == 0) | (labels == 1)).all()):
        frequencies = class_frequencies(labels, 2)
        if bool((frequencies > 0).all()):
            return frequencies, f"the labels' class frequencies ({frequencies[0]:.4g}, {frequencies[1]:.4g})"
    return torch.full((2,), 0.5, dtype=torch.float64), "uniform priors"


def _columns_to_logits(values: Tensor, kind: str, reason: str, tolerance: float, floor: float) -> tuple[Tensor, str]:
    if kind == "llr":
        raise ValueError(f"LLRs must be one score column; these scores have {values.shape[1]} columns.")
    if kind == "log_probs" and bool((values > 0).any()):  # (as for one column: probabilities read as logs)
        raise ValueError(f"log-probabilities must be <= 0; found positive values (up to {float(values.max()):.4g}). "
                         f"Are these probabilities (input='probs') or logits (input='logits')?")
    if kind in ("logits", "log_probs"):
        return values, f"{'logits' if kind == 'logits' else 'log-probabilities'} ({reason})"
    row_sums = values.sum(1, dtype=torch.float64)
    worst = int((row_sums - 1).abs().argmax())
    deviation = abs(float(row_sums[worst]) - 1)
    rounded_tolerance = max(ROUNDED_TOLERANCE, min(0.5, 0.005 * values.shape[1]))  # (a row of zeros: refused)
    if kind == "auto":
        if not _in_unit_interval(values):
            return values, "logits"
        if deviation > tolerance:
            advice = ("If these are rounded probabilities, pass input='probs' (--input probs) to renormalise the rows"
                      if deviation <= rounded_tolerance else "Too far from 1 for rounded probabilities: input='probs' refuses them too")
            return values, (
                f"{ROUNDED_READ_AS_LOGITS} and sums to 1 within {deviation:.2g} (row {worst}); "
                f"probabilities must sum to 1 within {tolerance:g}. {advice}"
            )
        note = "probabilities (every row lies in [0, 1] and sums to 1; input='logits' / --input logits overrides)"
    else:
        note = f"probabilities ({reason})"
        if not _in_unit_interval(values):
            raise ValueError("scores read as probabilities must lie in [0, 1]; found values outside. Are these logits?")
        if deviation > rounded_tolerance:
            raise ValueError(f"rows of probabilities must sum to one; row {worst} sums to {float(row_sums[worst]):.6g}.")
        if deviation > tolerance:
            note += f"; rows renormalised, they summed to 1 only within {deviation:.2g} (row {worst})"
            values = values / row_sums.unsqueeze(1).to(values.dtype)
    values = values.clamp(0, 1)  # (round-off outside it: _UNIT_SLACK)
    return floored_log(values.clamp_min(floor)), note + _floor_note(values, floor)


#: How ``read_as`` begins for scores that detection read as logits although every row lies in [0, 1]
#: and sums to 1 roughly (rounded probabilities, say): another file of the same system, exact
#: enough to be read as probabilities, would be read differently (report.check_read_alike).
ROUNDED_READ_AS_LOGITS = "logits, although every row lies in [0, 1]"


def _in_unit_interval(values: Tensor) -> bool:
    """Every value in [0, 1], but for round-off (_UNIT_SLACK)."""
    return bool(((values >= -_UNIT_SLACK) & (values <= 1 + _UNIT_SLACK)).all())


def _floor_note(probs: Tensor, floor: float) -> str:
    floored, zeros = int((probs < floor).sum()), int((probs == 0).sum())
    if not floored:
        return ""
    return f"; {floored} probabilities below {floor:g} ({zeros} of them 0) floored at it"
