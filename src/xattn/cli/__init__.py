"""The ``xattn`` command: ``xattn compare``, ``xattn bench`` and ``xattn train``.

``xattn compare`` measures how well each randomized estimator approximates exact softmax
attention (MSE, relative error, time, peak memory) as the number of samples grows, next
to the trivial uniform-attention baseline, and writes a table, a PNG and a JSON file.
``xattn bench`` measures time and peak memory against sequence length for every
estimator, exact softmax included, and reports where each linear-time estimator
overtakes exact softmax. ``xattn train`` trains a small Long Range Arena model with
each estimator as its attention (through :mod:`xattn.torch` or :mod:`xattn.flax`) on its
tasks (MQAR, ListOps, digits) and reports test accuracy, training loss, time per step and
peak memory. Run
``xattn <command> --help`` for the options.

This package is the application around the library, and only that: it parses the
arguments, plans the runs, runs them and prints and writes the reports. What it measures
or trains is the library's: the estimators of :mod:`xattn`, and for ``xattn train`` the
models, tasks and training loops of :mod:`xattn.training` (which never imports this
package). It imports public names only (:mod:`xattn`, :mod:`xattn.diagnostics`,
:mod:`xattn.training`, ...), never a private module of the library. It may import array
libraries (lazily, only the chosen backend), synchronize devices for timing and read their
memory counters. Figures are drawn with Matplotlib's Agg canvas (no display, no pyplot
state).

Modules, one concern each:

* :mod:`xattn.cli.registry`: the estimators ``compare`` and ``bench`` know
  (:data:`ESTIMATOR_SPECS`, each an :class:`EstimatorSpec`);
* :mod:`xattn.cli.measure`: backends, moving arrays onto them, synchronizing, timing and
  peak memory; :mod:`xattn.cli.figures`: the Agg figures (both also used by
  ``benchmarks/``, whose own helpers are in ``benchmarks/_common.py``);
  :mod:`xattn.cli.memory`: memory estimates, checked before a run;
* :mod:`xattn.cli.inputs`: reading and validating ``--input`` files;
* :mod:`xattn.cli.compare`, :mod:`xattn.cli.bench`, :mod:`xattn.cli.train`: the
  sub-commands, each with ``add_parser(subparsers)`` and ``run(args)``
  (:mod:`xattn.cli.decode`: ``xattn bench --decode``);
* :mod:`xattn.cli.train_report`: the table, JSON and figure of ``xattn train``;
  :mod:`xattn.cli.train_resume`: its ``--resume``; :mod:`xattn.cli.train_lm_report`:
  ``--task shakespeare`` (plan, checks, table, JSON and figure);
* :mod:`xattn.cli.common`, :mod:`xattn.cli.options`: what the sub-commands share (the
  usage error, the progress bar, the table, JSON and ``--out``; argument types and the
  common options, ``--out`` and ``--progress`` among them);
* :mod:`xattn.cli.parser`: the argument parser (every ``choices=`` checked and worded
  alike) and :func:`main`.
"""

from __future__ import annotations

from xattn.cli.bench import crossover_length
from xattn.cli.parser import build_parser, main
from xattn.cli.registry import ESTIMATOR_SPECS, EstimatorSpec

__all__ = ["ESTIMATOR_SPECS", "EstimatorSpec", "build_parser", "crossover_length", "main"]
