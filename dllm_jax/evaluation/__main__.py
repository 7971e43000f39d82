"""lm-eval's command line with the ``dllm_jax`` model registered.

    python -m dllm_jax.evaluation --model dllm_jax --model_args pretrained=PATH,method=flash_cache \\
        --tasks gsm8k --num_fewshot 5

Arguments are lm-eval's own (``lm_eval --help``). lm-eval 0.4.13 registers only its own models
from the command line, so this module imports the dllm_jax model first. The dllm_jax
model_args are checked before lm-eval indexes its tasks; a bad model_args key, generation
kwarg or rolling-loglikelihood task ends with one line and exit status 2.

When every task named by ``--tasks`` is a task defined in ``--include_path`` (local task
files, docs/evaluation.md), lm-eval indexes only that folder, not its thousands of built-in
task files as well (6-16 s on the 2-core CPU machine, at every start).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any


def main() -> int:
    """Runs lm-eval's command line on sys.argv (as lm_eval.__main__.cli_evaluate does)."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from dllm_jax.evaluation.lm_eval_model import GenerationKwargsError, LoglikelihoodRollingError
    from dllm_jax.evaluation.model_args import ModelArgsError, parse_model_args

    setup_logging()
    parser = HarnessCLI()
    args = parser.parse_args()
    try:
        if getattr(args, "model", None) == "dllm_jax" and getattr(args, "model_args", None):
            parse_model_args(dict(args.model_args))
        with index_only_the_include_path(args):
            parser.execute(args)
    except (ModelArgsError, GenerationKwargsError, LoglikelihoodRollingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def tasks_all_local(include_path: str | None, tasks: list[str] | None) -> bool:
    """Whether every name in ``tasks`` (lm-eval's --tasks, comma-split) is a task, not a group,
    tag, file or pattern, defined by the task files under ``include_path``."""
    if not include_path or not tasks:
        return False
    names = [t for task in tasks for t in task.split(",") if t]
    if not names or any(n.endswith(".yaml") or any(c in n for c in "*?[") for n in names):
        return False
    from lm_eval.tasks import TaskManager

    local = TaskManager(include_path=include_path, include_defaults=False)
    return all(n in local.all_subtasks for n in names)


@contextlib.contextmanager
def index_only_the_include_path(args: Any) -> Iterator[None]:
    """While lm-eval runs ``args``: its TaskManager leaves out the built-in tasks when every task
    asked for is defined under --include_path (tasks_all_local); otherwise nothing changes."""
    if not tasks_all_local(getattr(args, "include_path", None), getattr(args, "tasks", None)):
        yield
        return
    import lm_eval.tasks

    built_in = lm_eval.tasks.TaskManager

    class LocalTaskManager(built_in):
        def __init__(self, *a: Any, include_defaults: bool = True, **k: Any):
            super().__init__(*a, include_defaults=False, **k)

    lm_eval.tasks.TaskManager = LocalTaskManager  # lm-eval's run command imports it from there at run time
    try:
        yield
    finally:
        lm_eval.tasks.TaskManager = built_in


if __name__ == "__main__":
    sys.exit(main())
