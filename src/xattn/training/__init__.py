"""Training with the estimators as attention: the models, tasks and training loops of
``xattn train``, usable from Python.

The entry point is :func:`train`: one run (a task, an attention, a framework, a seed)
with exactly the model, data, optimization and result of the command line, which calls
the same functions. The parts:

* :mod:`xattn.training.tasks`: the tasks (``mqar``, ``listops``, ``digits``,
  ``shakespeare``), generated or shipped, as NumPy arrays;
* :mod:`xattn.training.loop`: the run configuration (:class:`ModelConfig`,
  :class:`RunSpec`), the schedule, batching and the training loop (:func:`train_run`)
  of the Long Range Arena classifier, and its :class:`RunResult`;
* :mod:`xattn.training.runs`: the task settings, the attention rows of each task, the
  framework's trainer module (:func:`load_framework`) and :func:`train`;
* :mod:`xattn.training.encoder_torch`, :mod:`xattn.training.encoder_flax`: the
  classifier and its training step in each framework;
* :mod:`xattn.training.lm`, :mod:`xattn.training.lm_torch`,
  :mod:`xattn.training.lm_flax`: the causal character-level GPT (``shakespeare``);
* :mod:`xattn.training.parity`: the parameters of both frameworks' classifiers in one
  layout, to train them from the same weights;
* :mod:`xattn.training.peak`: the peak memory of a PyTorch training step.

What it may import: the public xattn modules (:mod:`xattn`, :mod:`xattn.torch`,
:mod:`xattn.flax`, ...) and NumPy; never the command line (:mod:`xattn.cli`) nor a
private xattn module. PyTorch and JAX/Flax are imported only by the framework modules
(``encoder_*``, ``lm_*``) and inside functions (:mod:`xattn.training.parity`,
:mod:`xattn.training.peak`), so ``import xattn.training`` imports neither.
"""

from __future__ import annotations

from xattn.training.lm import GPTConfig, LMResult, LMSpec, train_lm_run
from xattn.training.loop import (
    ATTENTIONS,
    NATIVE,
    ModelConfig,
    RunResult,
    RunSpec,
    train_run,
)
from xattn.training.runs import (
    SETTINGS,
    TaskSettings,
    attention_variants,
    load_framework,
    train,
)
from xattn.training.tasks import TASKS, Dataset, Task, get_task

__all__ = ["ATTENTIONS", "NATIVE", "SETTINGS", "TASKS", "Dataset", "GPTConfig", "LMResult",
           "LMSpec", "ModelConfig", "RunResult", "RunSpec", "Task", "TaskSettings",
           "attention_variants", "get_task", "load_framework", "train", "train_lm_run",
           "train_run"]
