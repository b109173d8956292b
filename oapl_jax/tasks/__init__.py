"""Tasks: prompts, tokenizers and verifiable rewards. `make_task(config)` builds the configured one.

  base.py           Problem, the Task and Tokenizer interfaces
  registry.py       TASKS (task.name -> builder) and make_task
  rows.py           RowTask: what the row-based tasks share (read rows, drop eval questions,
                    host shard, check prompt lengths, draw)
  limits.py         prompt lengths against sampling.max_prompt_len
  arithmetic.py     addition (embedded, procedural) and its character tokenizer
  chain.py          chain_addition: addition answered by a chain of column steps (embedded)
  math.py, code.py  row-based tasks (code tests are read by oapl_jax/data/code_tests.py)
  reasoning_gym.py  procedural tasks of the reasoning_gym package
  hf_tokenizer.py   a Hugging Face tokenizer with its chat template
"""

from oapl_jax.tasks.arithmetic import AdditionTask, CharTokenizer
from oapl_jax.tasks.base import Problem, Task, Tokenizer
from oapl_jax.tasks.registry import TASKS, make_task

__all__ = ["TASKS", "AdditionTask", "CharTokenizer", "Problem", "Task", "Tokenizer", "make_task"]
