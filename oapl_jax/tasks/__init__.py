"""Tasks: prompts, tokenizers and verifiable rewards. `make_task(config)` builds the configured one."""

from oapl_jax.tasks.arithmetic import AdditionTask, CharTokenizer, Problem


def make_task(config):
  """Returns (task, tokenizer) for `config.task` (names validated in oapl_jax.config)."""
  t = config.task
  if t.name == "addition":
    return AdditionTask(t.min_digits, t.max_digits, t.num_eval, config.seed), CharTokenizer()
  raise ValueError(f"config.task.name={t.name!r}: unknown task")


__all__ = ["AdditionTask", "CharTokenizer", "Problem", "make_task"]
