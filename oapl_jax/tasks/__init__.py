"""Tasks: prompts, tokenizers and verifiable rewards. `make_task(config)` builds the configured one.

A task has `eval_problems()`, `train_problems(rng, n)` and `score(response, problem)`; a
tokenizer has `encode(text, add_bos=)`, `decode(ids)`, `vocab_size`, `pad_id`, `bos_id`, `eos_id`.
Every prompt a task makes must fit in `sampling.max_prompt_len` tokens (oapl_jax/tasks/limits.py):
`make_task` refuses a limit the addition task's prompts cannot fit in, and the data tasks treat a
row whose prompt is longer as a bad row (file and line named; skipped with task.skip_bad_rows).
"""

from oapl_jax.tasks.arithmetic import AdditionTask, CharTokenizer, Problem
from oapl_jax.tasks.limits import SETTING, prompt_tokens


def make_task(config):
  """Returns (task, tokenizer) for `config.task` (names validated in oapl_jax.config).

  Raises:
    ConfigError: `sampling.max_prompt_len` too small for the addition task's longest prompt,
      or for a generated reasoning_gym prompt.
    ValueError: a bad data row (a prompt too long for `sampling.max_prompt_len` is one).
  """
  t, max_prompt_len = config.task, config.sampling.max_prompt_len
  if t.name == "addition":
    task = AdditionTask(t.min_digits, t.max_digits, t.num_eval, config.seed)
    tokenizer = CharTokenizer()
    check_addition_prompts(task, tokenizer, max_prompt_len)
    return task, tokenizer
  from oapl_jax.tasks.hf_tokenizer import HFTokenizer  # noqa: PLC0415 (transformers import is slow)
  tokenizer = HFTokenizer(t.tokenizer_path or config.model.path)
  if t.name == "math":
    from oapl_jax.tasks.math import MathTask  # noqa: PLC0415
    task = MathTask(t.train_path, t.eval_path, tokenizer=tokenizer, question_field=t.question_field,
                    answer_field=t.answer_field, thinking=t.thinking, num_eval=t.num_eval,
                    fallback_last_number=t.fallback_last_number, skip_bad_rows=t.skip_bad_rows,
                    train_split=t.train_split, eval_split=t.eval_split, data_dir=t.data_dir,
                    reward_workers=t.reward_workers, max_prompt_len=max_prompt_len)
    return task, tokenizer
  if t.name == "code":
    from oapl_jax.tasks.code import CodeTask  # noqa: PLC0415
    return CodeTask.from_config(t, tokenizer, max_prompt_len=max_prompt_len), tokenizer
  if t.name == "reasoning_gym":
    from oapl_jax.tasks.reasoning_gym import ReasoningGymTask  # noqa: PLC0415
    return ReasoningGymTask.from_config(t, tokenizer, seed=config.seed,
                                        max_prompt_len=max_prompt_len), tokenizer
  raise ValueError(f"config.task.name={t.name!r}: unknown task")


def check_addition_prompts(task: AdditionTask, tokenizer, max_prompt_len: int) -> None:
  """Refuses a `sampling.max_prompt_len` the addition task's longest prompt does not fit in.

  Checked before the supervised warm-up, which would otherwise run for minutes and leave the
  failure to the first rollout. (Once the prompts fit, the warm-up's sequences,
  `max_prompt_len + max_new_tokens` long, hold every prompt and at least one answer token.)
  """
  from oapl_jax.config import ConfigError  # noqa: PLC0415 (config pulls in the model code)
  prompt = task.longest_prompt()
  need = prompt_tokens(tokenizer, prompt)
  if max_prompt_len < need:
    raise ConfigError(
        f"config.{SETTING}={max_prompt_len}: the addition task's longest prompt {prompt!r} "
        f"(task.max_digits={task.max_digits}) is {need} tokens with BOS; must be >= {need}")


__all__ = ["AdditionTask", "CharTokenizer", "Problem", "make_task"]
