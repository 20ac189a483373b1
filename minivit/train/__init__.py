"""Training a ViT from scratch (or fine-tuning one), or CLIP: the loop, its recipes and the command line.

    python -m minivit.train --dataset cifar10 --recipe fast --backend cupy --out runs/cifar10
    python -m minivit.train --dataset shapes --recipe demo              # offline, two minutes on a CPU
    python -m minivit.train --out runs/cifar10 --resume                 # continue where it stopped

The rooms, each importing only those above it:
    config.py      TrainConfig (every setting; the command line is generated from its fields), the recipes,
                   resolve, the run's length and evaluation cadence
    run_folder.py  OUT: the lock, metrics.jsonl, summary.json, atomic writes, the checks and restore of --resume
    tasks.py       what a run trains, behind one interface: ClassificationTask here, CLIPTask in clip/task.py
    loop.py        train(cfg) = set_up, run_loop, evaluate_and_save, finish; the signals; main

What is written to OUT: metrics.jsonl (one line per evaluation), summary.json, checkpoint.npz (model,
optimizer, RNG states, step; written atomically at every evaluation), curves.png. With out=None (from
Python) nothing is written: experiments/ call train(cfg, model=..., data=...) that way. An OUT that
already holds a run is refused unless --resume (continue it) or --overwrite (replace it) says what to do.

Reproducibility: the batches of step s are a function of (seed, s) alone: epoch e = s // steps_per_epoch
is shuffled by a generator seeded with (seed, e), and the augmentation of step s by one seeded with
(seed, s). Dropout generators are saved in the checkpoint. So a run stopped and resumed ends with
bit-for-bit the parameters of an uninterrupted one (on the CPU, same seed).
"""

from .config import (BASE, CLIP_RECIPE, DEFAULT_RECIPE, FROM_RECIPE, MODEL_FIELDS, OPTIMIZERS, PRECISIONS,
                     RECIPES, RESUME_APPLIED, RESUME_RUNTIME, RUN_FILES, TASKS, EvalSteps, TrainConfig,
                     evaluation_steps, option, resolve, run_length)
from .config import _parser  # noqa: F401  (the command line's parser, which tests read)
from .loop import (Run, SecondSignal, TrainingDiverged, TrainResult, build_optimizer, check_run_memory,
                   evaluate_and_save, finish, load_run_data, main, non_finite_params, release_out, run_loop, set_up,
                   train)
from .run_folder import (LOCK_FILE, REPLACED, RunFolderInUse, check_not_in_use, check_out, check_resume_flags,
                         check_resumed_data, lock_out, open_out, restore, resume_config, settle_replaced, unlock_out,
                         write_summary)
from .tasks import (CIFAR_UNAVAILABLE, ClassificationTask, announce_ops, batch_for_step, build_model, check_labels,
                    evaluate, prepare_data, task_type, train_step)

__all__ = ["BASE", "CLIP_RECIPE", "DEFAULT_RECIPE", "FROM_RECIPE", "MODEL_FIELDS", "OPTIMIZERS", "PRECISIONS",
           "RECIPES", "RESUME_APPLIED", "RESUME_RUNTIME", "RUN_FILES", "TASKS", "EvalSteps", "TrainConfig",
           "evaluation_steps", "option", "resolve", "run_length", "Run", "SecondSignal", "TrainingDiverged",
           "TrainResult", "build_optimizer", "check_run_memory", "evaluate_and_save", "finish", "load_run_data", "main",
           "non_finite_params", "release_out", "run_loop", "set_up", "train", "LOCK_FILE", "REPLACED",
           "RunFolderInUse", "check_not_in_use", "check_out", "check_resume_flags", "check_resumed_data", "lock_out",
           "open_out", "restore", "resume_config", "settle_replaced", "unlock_out", "write_summary",
           "CIFAR_UNAVAILABLE", "ClassificationTask", "announce_ops", "batch_for_step", "build_model", "check_labels",
           "evaluate", "prepare_data", "task_type", "train_step"]
