"""The ``torchcal`` command line: evaluate posteriors, fit a calibrator once, apply it many times.

    torchcal demo [--out DIR]
    torchcal evaluate SCORES [--calibration CAL | --cv K] [--method M,M] [--priors P] [--costs C]
                             [--bootstrap B] [--config NAME] [--out DIR]
    torchcal calibrate CAL_SCORES --method M --save head.pt [--target TARGET_SCORES]
    torchcal apply head.pt SCORES --out calibrated.npz

Bad files and bad options end with one line on stderr, ``torchcal: error: ...``, and exit code 2.

The heavy modules (torch, numpy, the workflow) are imported by the commands that use them, and a
subcommand's options are built only when that subcommand is named, so ``torchcal --help`` imports
none of them.
"""

from __future__ import annotations

import argparse
import importlib.resources
import logging
import math
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from torchcal import __version__

if TYPE_CHECKING:
    from importlib.abc import Traversable

    import torch

    from torchcal.calibrators import Calibrator
    from torchcal.data import Scores

__all__ = ["CONFIG_DIR", "load_config", "main", "parse_costs", "parse_priors"]


def _config_dir() -> Traversable:
    try:  # installed: the package torchcal.configs, which setuptools maps to the repository's configs/
        return importlib.resources.files("torchcal.configs")
    except ModuleNotFoundError:  # a source checkout on sys.path
        return Path(__file__).resolve().parents[1] / "configs"


#: Named configurations (``--config NAME``), shipped in the package.
CONFIG_DIR = _config_dir()
CONFIG_KEYS = {"description", "methods", "cv", "priors", "costs", "bootstrap", "seed", "options"}
DEMO_METHODS = ["temperature", "affine", "vector", "dirichlet-odir"]


class UsageError(ValueError):
    """A bad option; reported in one line with exit code 2."""


class _Parser(argparse.ArgumentParser):
    argv: Sequence[str] = ()  # (what main parses: error() looks for values that start with '-')

    def error(self, message: str) -> NoReturn:  # one line instead of usage + message
        if message.endswith("expected one argument") and any(re.fullmatch(r"-[\d.].*", a) for a in self.argv):
            # (argparse reads a value that starts with '-' as an option: --priors -0.1,1.1)
            message += " (a value that starts with '-' goes after '=', as in --priors=-0.1,1.1)"
        raise UsageError(f"{message} (see {self.prog} --help)")


# --- option parsing --------------------------------------------------------------------------------

def parse_priors(spec: Any, num_classes: int, where: str = "--priors") -> torch.Tensor | None:
    """``None``/``"data"`` (class frequencies), ``"uniform"``, or K comma-separated numbers / a list;
    messages name ``where`` the spec came from."""
    import torch

    from torchcal._validation import check_priors

    if spec is None or spec == "data":
        return None
    if spec == "uniform":
        return torch.full((num_classes,), 1 / num_classes, dtype=torch.float64)
    try:
        values = [float(x) for x in (spec.split(",") if isinstance(spec, str) else spec)]
    except (TypeError, ValueError):
        raise UsageError(f"{where} must be 'uniform', 'data' or {num_classes} comma-separated numbers, got {spec!r}.") from None
    if len(values) != num_classes:
        raise UsageError(f"{where} needs {num_classes} numbers (one per class), got {len(values)}.")
    positive = [k for k, v in enumerate(values) if v > 0]
    if len(positive) == 1 and all(v >= 0 for v in values):
        raise UsageError(f"{where} gives every class but class {positive[0]} prior 0: with one possible class there is "
                         f"nothing to calibrate or normalise by (the naive system is never wrong); give at least two "
                         f"classes a positive prior.")
    try:
        return check_priors(torch.tensor(values, dtype=torch.float64), num_classes)
    except ValueError as err:
        raise UsageError(f"{where}: {err}") from None


def parse_costs(spec: Any, num_classes: int, where: str = "--costs") -> tuple[torch.Tensor, str]:
    """A cost matrix and its name from ``"0-1"``, ``"abstain:ALPHA"`` (0-1 plus an abstain decision
    costing ALPHA), a (K, M) nested list, or a ``.csv``/``.txt``/``.npy`` file holding the matrix;
    messages name ``where`` the spec came from."""
    import numpy as np
    import torch

    from torchcal.functional import zero_one_costs

    if spec is None or spec == "0-1":
        return zero_one_costs(num_classes), "0-1"
    if isinstance(spec, list):
        try:
            matrix = torch.tensor(spec, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):  # ragged rows, or cells that are no numbers
            raise UsageError(f"{where} must be a K x M matrix of numbers, one list of M costs per class (e.g. "
                             f"[[0, 1], [1, 0]]), got {spec!r}.") from None
        return _checked_costs(matrix, num_classes, where), "custom"
    spec = str(spec)
    if spec.startswith("abstain:"):
        try:
            alpha = float(spec.split(":", 1)[1])
        except ValueError:
            raise UsageError(f"{where} abstain:ALPHA needs a number, got {spec!r}.") from None
        if not 0 < alpha < math.inf:
            raise UsageError(f"{where} abstain:ALPHA needs a finite ALPHA > 0, got {spec!r} (abstaining at no cost is always "
                             f"the best decision, and the normalised expected cost is undefined).")
        return zero_one_costs(num_classes, abstain=alpha), f"0-1 + abstain {alpha:g}"
    path = Path(spec)
    if not path.is_file():
        raise UsageError(f"{where} must be '0-1', 'abstain:ALPHA' or a cost-matrix file; no such file: {spec}.")
    try:
        stored = np.load(path) if path.suffix == ".npy" else np.loadtxt(path, delimiter="," if path.suffix == ".csv" else None, ndmin=2)
    except ValueError as err:
        raise ValueError(f"{path}: not a readable cost matrix ({err}).") from None
    return _checked_costs(stored, num_classes, f"{where} {path.name}"), path.name


def _checked_costs(matrix: Any, num_classes: int, where: str) -> torch.Tensor:
    """``matrix`` as a valid (K, M) cost matrix, or a ``UsageError`` naming ``where``."""
    from torchcal._validation import check_costs

    try:
        return check_costs(matrix, num_classes)
    except ValueError as err:
        raise UsageError(f"{where}: {err}") from None


def _check_naive_cost(args: argparse.Namespace, costs: torch.Tensor, priors: torch.Tensor | None, scores: Scores) -> None:
    """Refuse costs under which the best decision made without looking at the input costs nothing
    (the NEC's denominator): a decision free for every class the priors, or the labels' class
    frequencies, give weight."""
    from torchcal.functional import class_frequencies

    assert scores.labels is not None  # evaluated scores have labels
    reference = class_frequencies(scores.labels, scores.num_classes) if priors is None else priors
    naive = reference @ costs
    if not bool(naive.amin() > 0):
        weighted = "the labels' class frequencies" if priors is None else _where(args, "priors")
        raise UsageError(f"{_where(args, 'costs')}: decision {int(naive.argmin())} costs 0 for every class that "
                         f"{weighted} give weight, so the naive system is never wrong and the normalised expected cost "
                         f"(NEC) is undefined; give it a positive cost for one of those classes.")


def load_config(name: str | Path) -> dict[str, Any]:
    """Read a YAML configuration: a file, or a preset shipped in :data:`CONFIG_DIR` named by its name
    (``quick``) or by its path in the repository (``configs/quick.yaml``, from any directory).
    Unknown keys, and ``options`` under a name that is no method, are refused."""
    import yaml

    from torchcal.report import METHODS

    path: Path | Traversable = Path(name)
    if not path.is_file():
        given = Path(name)
        bare = given.suffix == "" and given.parent == Path(".")
        in_configs = given.suffix in (".yaml", ".yml") and not given.is_absolute() and given.parent.name == "configs"
        path = CONFIG_DIR / (f"{given.name}.yaml" if bare else given.name)
        if not ((bare or in_configs) and path.is_file()):
            available = sorted(p.name.removesuffix(".yaml") for p in CONFIG_DIR.iterdir() if p.name.endswith(".yaml"))
            raise UsageError(f"no config {str(name)!r}: not a file, and not one of {', '.join(available) or 'none'}.")
    try:
        config = yaml.load(path.read_text(), Loader=_yaml_loader()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML ({str(err).splitlines()[0]}).") from None
    if not isinstance(config, dict) or not set(config) <= CONFIG_KEYS:
        unknown = sorted(set(config) - CONFIG_KEYS) if isinstance(config, dict) else config
        raise ValueError(f"{path}: unknown config keys {unknown}; allowed: {', '.join(sorted(CONFIG_KEYS))}.")
    methods, options = config.get("methods"), config.get("options")
    if methods is not None and not (isinstance(methods, str) or (isinstance(methods, list) and all(isinstance(m, str) for m in methods))):
        raise ValueError(f"{path}: methods must be a list of method names (or one string 'a,b'), got {methods!r}.")
    if methods == []:  # would run no calibration, as `--method ""` may not
        raise ValueError(f"{path}: methods is empty; name one or more of {', '.join(METHODS)} or 'all' "
                         f"(or leave the key out for the default).")
    if options is not None and not (isinstance(options, dict) and all(isinstance(o, dict) for o in options.values())):
        raise ValueError(f"{path}: options must map method names to their options, e.g. "
                         f"{{dirichlet-odir: {{reg_lambda: 0.01}}}}; got {options!r}.")
    unknown = [name for name in options or {} if name not in METHODS]
    if unknown:  # a misspelt name would leave its method on the default options, silently
        raise ValueError(f"{path}: options for unknown method {_closest(unknown[0], list(METHODS))}; "
                         f"the methods are {', '.join(METHODS)}.")
    return config


def _yaml_loader() -> type:
    """PyYAML's safe loader, reading ``1e-2`` as the number YAML 1.2 makes it: YAML 1.1 floats need
    a dot (``1.0e-2``), so ``reg_lambda: 1e-2`` arrived as a string, refused with "'<=' not
    supported between instances of 'int' and 'str'". A key given twice in one mapping is refused
    (PyYAML keeps the last: a second ``options:`` block dropped the first's without a word)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # (<<: *anchor, which flattening merges)
                    continue
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, Hashable):  # (the constructor's own error says so)
                    continue
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} is given twice (line {key_node.start_mark.line + 1}); keep one", None)
                seen.add(key)
            return super().construct_mapping(node, deep)

    exponent_float = re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", exponent_float, list("-+0123456789."))
    return Loader


def _closest(name: Any, known: Sequence[str]) -> str:
    """``name`` quoted, with the known name it is likely a typo of, if any."""
    import difflib

    match = difflib.get_close_matches(str(name), known, n=1)
    return f"{name!r}" + (f" (did you mean {match[0]!r}?)" if match else "")


def _methods(spec: Any, num_classes: int) -> list[str]:
    """Method names from ``"a,b"`` or a list; ``"all"`` is every method that fits K classes."""
    from torchcal.report import METHODS, make_calibrator

    names = [str(m).strip() for m in (spec.split(",") if isinstance(spec, str) else spec)]  # ("a, b" too)
    if names == ["all"]:
        return [m for m in METHODS if make_calibrator(m).supported_num_classes in (None, num_classes)]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise UsageError(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)} or 'all'.")
    return names


# --- commands --------------------------------------------------------------------------------------

def _load(path: str, args: argparse.Namespace, priors: Any = None, **kwargs: Any) -> Scores:
    from torchcal.data import load_scores

    return load_scores(path, labels_path=getattr(args, "labels", None), input=args.input, priors=priors, **kwargs)


def _saved_reading(args: argparse.Namespace, scores: Scores) -> str | None:
    """How ``apply`` is to read new scores for a calibrator fitted on ``scores``: as declared
    (``--input``), or as probabilities where detection read the fit's scores as such. Detection
    reads each file on its own, and new rounded probabilities would be read as logits (NCE 0.671
    -> 0.829 where reading them as probabilities gives 0.682 -> 0.482)."""
    if args.input != "auto":
        return args.input
    return "probs" if scores.read_as.startswith("probabilities") else None


def _check_output(option: str, path: str, folder: bool, inputs: tuple[str | None, ...] = ()) -> None:
    """Refuse an output path that cannot be written before anything is fitted: a ``folder`` that
    is a file, a file that is a folder, one whose parent is a file, one of the command's ``inputs``
    (`apply head.pt s.npz --out head.pt` wrote its posteriors over the calibrator), or one in a
    folder where no file can be created (no permission, a read-only file system, /proc). Nothing
    is left behind: the nearest existing folder is tried with a file created and removed at once."""
    target = Path(path)
    for given in inputs:
        if given is not None and target.exists() and Path(given).exists() and target.samefile(given):
            raise UsageError(f"{option} {path} is also an input of this command ({given}): it would be overwritten; name another file.")
    if target.exists() and target.is_dir() != folder:
        raise UsageError(f"{option} {path}: {'a file' if folder else 'a folder'} is already there; name {'a folder' if folder else 'a file'}.")
    existing = next(p for p in (target, *target.parents) if p.exists())  # the last parent, '.' or '/', exists
    if existing == target and not folder:  # a file to overwrite
        if not os.access(target, os.W_OK):
            raise UsageError(f"{option} {path}: the file is there and cannot be overwritten (no permission); name another file.")
        return
    if not existing.is_dir():
        raise UsageError(f"{option} {path}: {existing} is a file, not a folder.")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".torchcal-write-test-"):
            pass
    except OSError as err:
        raise UsageError(f"{option} {path}: cannot create files in {existing} ({err.strerror or err}); "
                         f"name a location you can write to.") from None


def _with_two_classes(scores: Scores, path: str) -> Scores:
    """``scores``, unless every label is one class (refused before anything is fitted or written)."""
    present = scores.labels.unique() if scores.labels is not None else None
    if present is not None and present.numel() == 1:
        raise UsageError(
            f"{path}: every label is class {int(present[0])}; calibration and the normalised scores (NCE, "
            f"NBS, calibration loss), which compare with the naive system of the class priors, need two classes present."
        )
    return scores


def _calibration_split(path: str) -> Literal["test", "val"]:
    """The split of ``path`` to fit calibrators on: its validation split when it has one (its main
    split then stays for evaluation), else the file."""
    from torchcal.data import has_split

    return "val" if has_split(path) else "test"


def _binary_priors(spec: Any) -> torch.Tensor | None:
    """The priors that turn one column of binary LLRs into posteriors, if ``spec`` gives two."""
    try:
        return parse_priors(spec, 2)
    except UsageError:
        return None


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """Config file values, overridden by the options given on the command line."""
    config = load_config(args.config) if getattr(args, "config", None) else {}
    given = {k: getattr(args, k) for k in ("methods", "cv", "priors", "costs", "bootstrap", "seed")
             if getattr(args, k, None) is not None}
    return config | given


def _where(args: argparse.Namespace, key: str) -> str:
    """Where a setting came from, for messages: ``--key``, or the config file and its key."""
    return f"--{key}" if getattr(args, key, None) is not None else f"{args.config}: {key}"


def _integer(args: argparse.Namespace, settings: dict[str, Any], key: str, default: int, minimum: int, what: str,
             below: float = math.inf) -> int:
    """An integer setting in ``[minimum, below)``, checked: given as ``--key`` or in the config file (which is named)."""
    value = settings.get(key, default)
    if (isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < below
            or (key == "bootstrap" and value == 1)):
        raise UsageError(f"{_where(args, key)} must be {what}, got {value!r}.")
    return value


#: Scores of at least this many entries (e.g. 50,000 x 200) make ``evaluate`` keep freed memory.
_LARGE_SCORES = 10_000_000


def _keep_freed_memory(keep: bool = True) -> None:
    """Make glibc keep large freed blocks for reuse instead of returning them to the system
    (``keep=False``: give them back, and map large blocks afresh again, at glibc's default
    thresholds; its threshold that adapts to freed blocks stays off once set, mallopt(3)).

    The metrics' (N, K) float64 temporaries are far above the 32 MB up to which glibc keeps freed
    blocks in its heap, so each was mapped afresh and faulted in page by page: at 50,000 x 1,000
    ``evaluate`` spent 41 of its 123 CPU seconds in the kernel (21.6 million page faults); with
    this, 8 s (2.4 million), 2:04 -> 1:36 wall. The figures, drawn after the metrics, allocate
    blocks of many other sizes, which the kept heap fragments into: ``--method temperature`` there
    peaked at 7.7 GB (1.9 GB with glibc's defaults; a review), so they are drawn with the freed
    memory given back. The command line owns its process; the library leaves the allocator to its
    users. A no-op without glibc.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    if keep:
        mallopt(m_mmap_max, 0)  # every block from the heap, which keeps freed ones
        mallopt(m_trim_threshold, 2**31 - 1)  # and does not give its free top back
    else:
        mallopt(m_mmap_max, 65536)  # glibc's defaults
        mallopt(m_trim_threshold, 128 * 1024)
        malloc_trim(0)


def _evaluate(args: argparse.Namespace, scores_path: str, calibration: Scores | None, default_methods: Sequence[str]) -> int:
    from torchcal.data import has_split, load_scores
    from torchcal.report import evaluate

    settings = _settings(args)
    _check_output("--out", args.out, folder=True)
    raw_priors = settings.get("priors")
    scores = _with_two_classes(_load(scores_path, args, priors=_binary_priors(raw_priors)), scores_path)
    if scores.logits.numel() >= _LARGE_SCORES:
        _keep_freed_memory()
    k = scores.num_classes
    # binary LLRs of the calibration data become posteriors with the evaluated scores' priors: the
    # calibrators learn the map that the evaluated scores then go through
    if calibration is None and args.calibration:
        calibration = load_scores(args.calibration, labels_path=args.calibration_labels, input=args.input,
                                  split=_calibration_split(args.calibration), priors=scores.llr_priors,
                                  labels_option="--calibration-labels")
    elif calibration is None and args.cv is None and has_split(scores_path):
        # the file's own held-out split; --cv on the command line chooses cross-validation instead,
        # a config's cv does not (it is a preset's default, as in the demo: see _warn_of_unused_options)
        calibration = load_scores(scores_path, input=args.input, split="val", priors=scores.llr_priors)
    if calibration is not None:  # (one class: the calibrators fitted degenerate maps, and the verdict blamed them)
        calibration = _with_two_classes(calibration, getattr(args, "calibration", None) or f"{scores_path} (validation split)")
    costs, costs_name = parse_costs(settings.get("costs"), k, _where(args, "costs"))
    priors = parse_priors(raw_priors, k, _where(args, "priors"))
    _check_naive_cost(args, costs, priors, scores)
    methods = _methods(settings.get("methods", default_methods), k)
    separate = None if calibration is None else args.calibration or f"the validation split of {scores_path}"
    _warn_of_unused_options(args, settings, methods, separate)
    report = evaluate(
        scores,
        methods,
        calibration=calibration,
        folds=_integer(args, settings, "cv", 5, 2, "an integer >= 2 (the number of folds)"),
        priors=priors,
        costs=costs,
        costs_name=costs_name,
        bootstrap=_integer(args, settings, "bootstrap", 1000, 0, "0 (no intervals) or an integer >= 2 (replicates)"),
        seed=_integer(args, settings, "seed", 0, 0, "an integer in [0, 2**64)", below=2**64),  # (torch's generators' range)
        method_options=settings.get("options"),
        progress=not args.quiet,
    )
    print(report.table())
    stale = report.stale_files(args.out, figures=not args.no_figures)  # an earlier run's, by torchcal's names only
    for path in stale:
        path.unlink()
    if scores.logits.numel() >= _LARGE_SCORES:
        _keep_freed_memory(False)  # (before the figures: see there)
    written = report.save(args.out, figures=not args.no_figures, progress=not args.quiet,
                          input_kind=_saved_reading(args, scores))
    if not args.quiet:
        print(f"\nwrote {', '.join(p.name for p in written)} to {args.out}/")
        if stale:
            print(f"removed {len(stale)} file{'s' if len(stale) > 1 else ''} of an earlier report: "
                  f"{', '.join(p.name for p in stale)}")
    return 0


def _warn_of_unused_options(args: argparse.Namespace, settings: dict[str, Any], methods: list[str], separate: str | None) -> None:
    """Warn of config options for a method that is not run, unless ``--method`` chose the methods
    (then leaving some of the config's out is the point), and of a config's ``cv`` where the
    calibrators are fitted on ``separate`` calibration data (its name: ``--calibration``, the
    scores' own validation split)."""
    unused = [m for m in settings.get("options") or {} if m not in methods]
    if unused and args.methods is None:
        warnings.warn(f"{args.config}: the options for {', '.join(unused)} are not used: not among the methods run "
                      f"({', '.join(methods)}); add {'it' if len(unused) == 1 else 'them'} to methods.", stacklevel=2)
    if separate is not None and settings.get("cv") is not None:
        warnings.warn(f"{args.config}: cv is not used: the calibrators are fitted on separate calibration data ({separate}).",
                      stacklevel=2)


def cmd_evaluate(args: argparse.Namespace) -> int:
    if args.calibration_labels is not None and args.calibration is None:
        raise UsageError("--calibration-labels labels the --calibration scores, and none were given: add "
                         "--calibration CAL_SCORES, or pass the labels of SCORES with --labels.")
    return _evaluate(args, args.scores, None, ["temperature", "affine"])


def cmd_demo(args: argparse.Namespace) -> int:
    from torchcal.data import EXAMPLE_PATH, load_scores

    if not args.quiet:
        print(f"demo: ResNet-110 CIFAR-10 logits (Kängsepp, MIT), bundled at {EXAMPLE_PATH}\n"
              f"calibrators fitted on its 5000-sample validation split, evaluated on its 10000 test samples\n")
    calibration = load_scores(EXAMPLE_PATH, split="val")
    args.input, args.labels, args.calibration, args.cv = "auto", None, None, None
    return _evaluate(args, str(EXAMPLE_PATH), calibration, DEMO_METHODS)


def _label_shift_source(args: argparse.Namespace, scores: Scores, priors: torch.Tensor | None, calibrator: Calibrator) -> torch.Tensor:
    """The source priors that ``--target`` re-weights, those the (unfitted) ``calibrator`` is fitted
    for (``--priors``, else the class frequencies of the calibration scores), checked before the
    fit: all positive, and ``--priors`` only for a calibrator that can move its posteriors to them."""
    from torchcal.functional import class_frequencies

    assert scores.labels is not None  # calibration data always have labels
    if priors is not None and not calibrator._shifts_class_priors():
        raise UsageError(
            f"--target with {_where(args, 'priors')}: {args.method} has no per-class bias, so a fit weighted for the "
            f"priors cannot move its posteriors to them, and the target re-weighting would start from priors they do "
            f"not assume. Leave out the priors (the source priors are then the class frequencies), or use a method "
            f"with a bias such as affine."
        )
    source = class_frequencies(scores.labels, scores.num_classes) if priors is None else priors
    zero = (source == 0).nonzero().flatten().tolist()
    if zero:
        which = f"classes {zero}" if len(zero) > 1 else f"class {zero[0]}"
        if priors is None:
            where = f"{args.scores} has no sample of {which} (its class frequencies are the source priors)"
        else:
            where = f"{_where(args, 'priors')} gives {which} prior 0"
        raise UsageError(
            f"--target re-weights the calibrated posteriors by target / source priors, so every class needs a "
            f"positive source prior, but {where}."
        )
    return source


def _load_target(args: argparse.Namespace, scores: Scores) -> Scores:
    """The unlabelled ``--target`` scores, read as the calibration ``scores`` were; checked before the fit."""
    from torchcal.data import load_scores
    from torchcal.report import check_read_alike

    target = load_scores(args.target, input=args.input, priors=scores.llr_priors, require_labels=False)
    if target.num_classes != scores.num_classes:
        raise ValueError(f"--target {args.target}: {target.num_classes} classes, but {args.scores} has "
                         f"{scores.num_classes}; the target scores must come from the same classifier.")
    check_read_alike(scores, target, "the calibration scores", "the --target scores")
    return target


def _estimate_target_priors(
    args: argparse.Namespace, source: torch.Tensor, target: Scores, calibrator: Calibrator, method: str, source_name: str
) -> dict[str, torch.Tensor]:
    """Label shift: the class priors of the unlabelled ``--target`` scores, by maximum likelihood on
    their calibrated posteriors (``torchcal.label_shift.estimate_priors``), printed with their
    standard errors beside the ``source`` priors (named ``source_name``); a warning if the estimate
    stopped short of the maximum."""
    import torch

    from torchcal.fit import ConvergenceWarning
    from torchcal.label_shift import estimate_priors, smoothed_priors

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # said below, naming --target
        estimate = estimate_priors(calibrator(target.logits), source)
    if not estimate.record.converged:
        warnings.warn(f"--target: the prior estimate {estimate.record.message}; the priors printed are where it stopped.",
                      ConvergenceWarning, stacklevel=2)
    print(f"target priors estimated from {target.num_samples} unlabelled samples of {args.target} "
          f"(maximum likelihood on the {method}-calibrated scores; +- one standard error):")
    for k, (p, se, s) in enumerate(zip(estimate.priors.tolist(), estimate.stderr.tolist(), source.tolist())):
        print(f"  class {k}: {p:.4f} +- {se:.4f}   ({source_name}: {s:.4f})")
    # what `apply` adapts to: half a target sample added to every class, so none gets probability 0
    return {"source_priors": source, "target_priors": smoothed_priors(estimate.priors, target.num_samples),
            "stderr": estimate.stderr}


def cmd_calibrate(args: argparse.Namespace) -> int:
    import torch

    from torchcal.functional import cross_entropy
    from torchcal.report import fit_calibrator, make_calibrator, save_calibrator

    settings = _settings(args)
    method = args.method
    options = (settings.get("options") or {}).get(method, {})
    unfitted = make_calibrator(method, **options)  # bad names and options fail before the data are read
    if getattr(args, "config", None):  # (evaluate's settings, and other methods' options: said, not dropped)
        unused = sorted(k for k in settings if k not in ("options", "priors", "description"))
        unused += [f"options for {m}" for m in settings.get("options") or {} if m != method]
        if unused:
            warnings.warn(f"{args.config}: {', '.join(unused)} not used by calibrate, which fits one method "
                          f"(--method {method}) on all the data given.", stacklevel=2)
    split = _calibration_split(args.scores)
    scores = _with_two_classes(_load(args.scores, args, priors=_binary_priors(settings.get("priors")), split=split), args.scores)
    where = f"{scores.num_samples} samples" + (" (the file's validation split)" if split == "val" else "")
    labels = scores.labels
    assert labels is not None  # load_scores requires them here
    priors = parse_priors(settings.get("priors"), scores.num_classes, _where(args, "priors"))
    if args.save is None and args.target is None:
        raise UsageError("calibrate needs --save PATH, --target TARGET_SCORES, or both (see torchcal calibrate --help)")
    if args.save is not None:
        inputs = (args.scores, args.target, getattr(args, "labels", None), getattr(args, "config", None))
        _check_output("--save", args.save, folder=False, inputs=inputs)
    shift = (_label_shift_source(args, scores, priors, unfitted), _load_target(args, scores)) if args.target else None
    if not args.quiet:
        print(f"fitting {method} on {where} ...", file=sys.stderr, flush=True)
    calibrator = fit_calibrator(method, options, scores.logits, labels, priors=priors)
    if shift is not None and priors is None:
        from torchcal.label_shift import warn_unless_calibrated_to_frequencies

        warn_unless_calibrated_to_frequencies(calibrator, scores.logits, labels)
    # the source priors are the given priors (--priors or the config's), else the class frequencies
    priors_name = "calibration data" if priors is None else _where(args, "priors")
    label_shift = None if shift is None else _estimate_target_priors(args, *shift, calibrator, method, priors_name)
    if args.save is None:
        return 0
    save_calibrator(args.save, method, calibrator, options, label_shift, scores.llr_priors,
                    _saved_reading(args, scores))
    if not args.quiet:
        with torch.no_grad():
            after = cross_entropy(calibrator(scores.logits), labels, priors=priors, normalize=True)
        before = cross_entropy(scores.logits, labels, priors=priors, normalize=True)
        weighted = "" if priors is None else f" under {priors_name}"
        print(f"fitted {method} on {where} ({scores.num_classes} classes; scores read as "
              f"{scores.read_as}); NCE{weighted} on these same samples {float(before):.3f} -> {float(after):.3f} "
              f"(optimistic: use `torchcal evaluate` for an honest estimate)")
        print(f"saved to {args.save}")
    return 0


#: What ``torchcal apply --out`` writes, by extension.
APPLY_FORMATS = {
    ".npz": "calibrated log-posteriors ('logits') and posteriors ('probs')",
    ".pt": "a dict of calibrated log-posteriors ('logits') and posteriors ('probs')",
    ".csv": "calibrated posteriors, one column per class (prob_0, prob_1, ...)",
}


def _write_calibrated(path: Path, log_probs: torch.Tensor, labels: torch.Tensor | None) -> None:
    """Write calibrated scores in the format ``path``'s extension names (see :data:`APPLY_FORMATS`);
    the labels go along when the input had them."""
    import numpy as np
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        probs = log_probs.exp().double().numpy()
        names = [f"prob_{k}" for k in range(probs.shape[1])]
        table = probs if labels is None else np.column_stack([probs, labels.numpy()])
        formats = ["%.9g"] * probs.shape[1] + ([] if labels is None else ["%d"])
        np.savetxt(path, table, fmt=formats, delimiter=",", header=",".join(names + ([] if labels is None else ["label"])),
                   comments="")
        return
    out: dict[str, Any] = {"logits": log_probs.float(), "probs": log_probs.exp().float()}
    if labels is not None:
        out["labels"] = labels
    if suffix == ".pt":
        torch.save(out, path)
    else:
        with path.open("wb") as f:  # a file object: numpy would append .npz to another name
            np.savez(f, **{k: v.numpy() for k, v in out.items()})


def cmd_apply(args: argparse.Namespace) -> int:
    import torch

    from torchcal.functional import cross_entropy
    from torchcal.label_shift import adapt_to_priors
    from torchcal.report import load_saved_calibrator

    out_path = Path(args.out)
    if out_path.suffix.lower() not in APPLY_FORMATS:
        raise UsageError(f"--out {args.out}: unsupported extension {out_path.suffix or '(none)'!r}; use "
                         f"{', '.join(APPLY_FORMATS)}.")
    _check_output("--out", args.out, folder=False, inputs=(args.head, args.scores, getattr(args, "labels", None)))
    method, calibrator, saved_label_shift, llr_priors, input_kind = load_saved_calibrator(args.head)
    # read as at the fit (e.g. rounded probabilities) where the file does not say otherwise
    scores = _load(args.scores, args, require_labels=False, priors=llr_priors, fallback=input_kind)  # LLRs: as at the fit
    if scores.num_classes != calibrator.num_classes:
        raise ValueError(f"{args.scores}: {scores.num_classes} classes, but the calibrator was fitted on {calibrator.num_classes}.")
    label_shift = None if args.no_label_shift else saved_label_shift
    with torch.no_grad():
        calibrated = calibrator(scores.logits)
        if label_shift is not None:  # saved by `calibrate --target`: the deployment priors
            calibrated = adapt_to_priors(calibrated, label_shift["source_priors"], label_shift["target_priors"])
    _write_calibrated(out_path, calibrated, scores.labels)
    if not args.quiet:
        note = "" if label_shift is None else "; adapted to the target priors saved with it (--no-label-shift: not)"
        if scores.labels is not None:
            present = scores.labels.unique()  # of one class, the NCE's naive system scores 0: no NCE
            one_class = present.numel() == 1
            before, after = (float(cross_entropy(x, scores.labels, normalize=not one_class)) for x in (scores.logits, calibrated))
            note += (f"; cross-entropy {before:.4f} -> {after:.4f} nats (every label is class {int(present[0])}: "
                     f"no NCE, which needs two classes)" if one_class else
                     f"; NCE (at these labels' class frequencies) {before:.3f} -> {after:.3f}")
        print(f"applied {method} to {scores.num_samples} samples (scores read as {scores.read_as}){note}; wrote "
              f"{APPLY_FORMATS[out_path.suffix.lower()]} to {args.out}")
    return 0


# --- the parser ------------------------------------------------------------------------------------

def _input_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--labels", metavar="FILE", help="labels file, when the scores file has none")
    p.add_argument("--input", choices=["auto", "logits", "probs", "log_probs", "llr"], default="auto",
                   help="what the scores are; 'auto' reads logits unless rows are provably probabilities "
                        "(a single binary column needs 'probs', 'log_probs', 'llr' or 'logits' (a sigmoid head's log-odds) "
                        "unless its values prove LLRs)")


def _method_names() -> str:
    from torchcal.report import METHODS

    return ", ".join(METHODS)


def _evaluation_options(p: argparse.ArgumentParser, methods_default: str) -> None:
    p.add_argument("--method", dest="methods", metavar="M[,M...]",
                   help=f"calibration methods (default: {methods_default}); 'all' or any of: {_method_names()}")
    p.add_argument("--priors", help="deployment priors: 'uniform', 'data' (default) or K comma-separated numbers")
    p.add_argument("--costs", help="cost matrix of the Bayes risk: '0-1' (default), 'abstain:ALPHA', or a K x M .csv/.txt/.npy file")
    p.add_argument("--bootstrap", type=int, metavar="B", help="bootstrap replicates for the intervals and the test against temperature scaling (default 1000; 0: "
                   "neither, the lowest NCE wins)")
    p.add_argument("--seed", type=int, help="seed of the folds and of the bootstrap (default 0)")
    p.add_argument("--config", metavar="NAME|FILE", help="a YAML configuration (a file, or the name of a preset: "
                                                         f"{_config_names()}); options given here win")
    p.add_argument("--no-figures", action="store_true", help="skip the PNG figures")
    p.add_argument("--quiet", action="store_true", help="no progress bar or notes")
    _verbose_option(p)


def _verbose_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true",
                   help="say what long fits are doing: every Newton step and every regularisation strength tried")


def _config_names() -> str:
    return ", ".join(sorted(p.name.removesuffix(".yaml") for p in CONFIG_DIR.iterdir() if p.name.endswith(".yaml")))


def _evaluate_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("scores", metavar="SCORES", help="scores and labels: .npz, .npy, .pt/.pth or .csv")
    _input_options(p)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--calibration", metavar="CAL_SCORES", help="separate calibration data to fit the calibrators on "
                       "(an .npz with a validation split: that split)")
    where.add_argument("--cv", type=int, metavar="K", help="fit by K-fold cross-validation on SCORES (default when "
                                                            "SCORES has no validation split: 5)")
    p.add_argument("--calibration-labels", metavar="FILE", help="labels file for CAL_SCORES")
    _evaluation_options(p, "temperature,affine")
    p.add_argument("--out", default="torchcal-report", metavar="DIR", help="output folder (default: torchcal-report)")
    p.set_defaults(run=cmd_evaluate)


def _demo_options(p: argparse.ArgumentParser) -> None:
    _evaluation_options(p, ",".join(DEMO_METHODS))
    p.add_argument("--out", default="torchcal-report-demo", metavar="DIR", help="output folder (default: torchcal-report-demo)")
    p.set_defaults(run=cmd_demo)


def _calibrate_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("scores", metavar="CAL_SCORES", help="calibration scores with labels (an .npz with a validation "
                   "split: that split)")
    _input_options(p)
    p.add_argument("--method", required=True, metavar="M", help=f"one of: {_method_names()}")
    p.add_argument("--save", metavar="PATH", help="where to write the fitted calibrator (.pt), with the --target priors")
    p.add_argument("--target", metavar="TARGET_SCORES", help="unlabelled deployment scores: estimate their class "
                   "priors (label shift) and print them with standard errors")
    p.add_argument("--priors", help="deployment priors the fit weights the classes to (venn-abers: its posteriors moved to them by Bayes' rule)")
    p.add_argument("--config", metavar="NAME|FILE", help="YAML configuration supplying method options and priors "
                   "(--priors wins)")
    p.add_argument("--quiet", action="store_true", help="no progress line or summary (the --target priors and warnings still print)")
    _verbose_option(p)
    p.set_defaults(run=cmd_calibrate)


def _apply_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("head", metavar="CALIBRATOR", help="a .pt file from `torchcal calibrate --save` or evaluate's calibrator.pt")
    p.add_argument("scores", metavar="SCORES", help="scores to calibrate; labels optional; with --input auto, "
                   "scores whose file does not say what they are (an .npz key such as 'probs') are read as the "
                   "calibrator's were, where their values allow it")
    _input_options(p)
    p.add_argument("--out", required=True, metavar="FILE", help="output file; its extension says what is written: "
                   + "; ".join(f"{ext} {what}" for ext, what in APPLY_FORMATS.items()))
    p.add_argument("--no-label-shift", action="store_true",
                   help="ignore target priors saved by `calibrate --target` (default: adapt the posteriors to them)")
    p.add_argument("--quiet", action="store_true", help="no summary line (warnings still print)")
    p.set_defaults(run=cmd_apply)


#: The subcommands: (help, description, the function adding their options).
COMMANDS: dict[str, tuple[str, str, Callable[[argparse.ArgumentParser], None]]] = {
    "evaluate": ("how good are the posteriors, and which calibration fixes them",
                 "Measure the posteriors in SCORES, calibrate them with each method (fitted on --calibration data, "
                 "the file's own validation split, or by cross-validation), and save the best calibrator, a report "
                 "and figures.", _evaluate_options),
    "demo": ("run evaluate on the bundled ResNet-110 CIFAR-10 example",
             "The whole workflow on a real example shipped with torchcal; no network needed.", _demo_options),
    "calibrate": ("fit one calibrator on calibration data and save it",
                  "Fit METHOD on all of CAL_SCORES and save it for `torchcal apply`.", _calibrate_options),
    "apply": ("apply a saved calibrator to new scores",
              "Calibrate SCORES with a calibrator saved by `torchcal calibrate` or `evaluate`.", _apply_options),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with ``command``, only that subcommand gets its options (the others are
    listed by name), so that building it imports only what that subcommand needs."""
    parser = _Parser(prog="torchcal", description="Measure and fix the quality of classifier posteriors.")
    parser.add_argument("--version", action="version", version=f"torchcal {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (help_line, description, add_options) in COMMANDS.items():
        p = sub.add_parser(name, help=help_line, description=description)
        if command is None or command == name:
            add_options(p)
    return parser


#: How torch's CPU allocator says it is out of memory ("DefaultCPUAllocator: can't allocate memory: you
#: tried to allocate ... bytes"), and other allocators ("out of memory"); not "memory format".
_OUT_OF_MEMORY = re.compile(r"can't allocate memory|out of memory", re.IGNORECASE)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0, or 2 for bad input)."""
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        named = next((a for a in argv if not a.startswith("-")), "")
        _Parser.argv = tuple(argv)  # (every parser's, the subcommands' included)
        args = build_parser(named if named in COMMANDS else "").parse_args(argv)
        if getattr(args, "verbose", False):
            _log_to_stderr()
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning
            return args.run(args)
    except (ValueError, OSError) as err:  # bad input, or a file that cannot be read or written
        print(f"torchcal: error: {err}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as err:  # torch's allocators raise RuntimeError (OutOfMemoryError is one)
        if not isinstance(err, MemoryError) and not _OUT_OF_MEMORY.search(str(err)):  # (torch.OutOfMemoryError's: "CUDA out of memory")
            raise
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        print(f"torchcal: error: out of memory ({first_line}): the scores, the K x K cost matrix (K classes) and the "
              f"calibrators' work arrays must fit; evaluate a subset of the samples or fewer methods (--method "
              f"temperature), or use a machine with more memory.", file=sys.stderr)
        return 2


class _ProgressBarSafeHandler(logging.Handler):
    """torchcal's log on stderr, written above any progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        tqdm.write(f"torchcal: {self.format(record)}", file=sys.stderr)


def _log_to_stderr() -> None:
    """``--verbose``: show torchcal's log (the solvers' steps) on stderr."""
    logger = logging.getLogger("torchcal")
    if not any(isinstance(h, _ProgressBarSafeHandler) for h in logger.handlers):
        logger.addHandler(_ProgressBarSafeHandler())
    logger.setLevel(logging.DEBUG)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"torchcal: warning: {message}", file=sys.stderr)  # (above a progress bar, not glued to it)


if __name__ == "__main__":
    sys.exit(main())
