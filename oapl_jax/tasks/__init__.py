"""Tasks: prompts, tokenizers and verifiable rewards. `make_task(config)` builds the configured one.

A task has `eval_problems()`, `train_problems(rng, n)` and `score(response, problem)`; a
tokenizer has `encode(text, add_bos=)`, `decode(ids)`, `vocab_size`, `pad_id`, `bos_id`, `eos_id`.
"""

from oapl_jax.tasks.arithmetic import AdditionTask, CharTokenizer, Problem


def make_task(config):
  """Returns (task, tokenizer) for `config.task` (names validated in oapl_jax.config)."""
  t = config.task
  if t.name == "addition":
    return AdditionTask(t.min_digits, t.max_digits, t.num_eval, config.seed), CharTokenizer()
  from oapl_jax.tasks.hf_tokenizer import HFTokenizer  # noqa: PLC0415 (transformers import is slow)
  tokenizer = HFTokenizer(t.tokenizer_path or config.model.path)
  if t.name == "math":
    from oapl_jax.tasks.math import MathTask  # noqa: PLC0415
    task = MathTask(t.train_path, t.eval_path, tokenizer=tokenizer, question_field=t.question_field,
                    answer_field=t.answer_field, thinking=t.thinking, num_eval=t.num_eval,
                    fallback_last_number=t.fallback_last_number, skip_bad_rows=t.skip_bad_rows,
                    train_split=t.train_split, eval_split=t.eval_split, data_dir=t.data_dir,
                    reward_workers=t.reward_workers)
    return task, tokenizer
  if t.name == "code":
    from oapl_jax.tasks.code import CodeTask  # noqa: PLC0415
    return CodeTask.from_config(t, tokenizer), tokenizer
  if t.name == "reasoning_gym":
    from oapl_jax.tasks.reasoning_gym import ReasoningGymTask  # noqa: PLC0415
    return ReasoningGymTask.from_config(t, tokenizer, seed=config.seed), tokenizer
  raise ValueError(f"config.task.name={t.name!r}: unknown task")


__all__ = ["AdditionTask", "CharTokenizer", "Problem", "make_task"]
