"""Convert stored agent traces (JSONL, the common chat format) into an offline round file.

  python -m oapl_jax.import_traces --config=configs/math.py --traces=traces.jsonl --out=/tmp/round1.npz
  python -m oapl_jax.main --config=configs/math.py --workdir=/tmp/run --config.rl.mode=offline \\
      --config.rl.offline.path=/tmp/round1.npz --config.rl.offline.rounds=1

Each line is a trajectory: `messages` (system / user / assistant / tool, assistant messages
with optional `tool_calls`, `logprobs` and `token_ids`), a `reward`, optional `tools`
(oapl_jax/rl/traces.py has the format; docs/agents.md why this is a conversion and not read at
run time). The messages are tokenized through the config's tokenizer and its chat template;
assistant tokens are the targets, everything else context. The file written is an ordinary
round file (oapl_jax/rl/offline.py) with one more array, `answer_model`, flagging the model's
tokens, and its header says whether log-probs are stored (without them the run rescores pi_old
with its base and says so). A malformed line is refused with one line on stderr naming its line
number, and the rest are kept; prompts whose trajectories do not fill whole groups of
`rl.group_size` have the rest left out, one line each. No trajectory left: exit 2.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from oapl_jax import config as config_lib  # noqa: E402
from oapl_jax import errors, storage  # noqa: E402
from oapl_jax.workdir import check_output_file  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:arg]).", lock_config=True)
_TRACES = flags.DEFINE_string("traces", None, "The JSONL file of trajectories to import.")
_OUT = flags.DEFINE_string("out", None, "The round file to write (.npz).")
flags.mark_flags_as_required(["config", "traces", "out"])


def import_traces(config, traces: str, out: str, *, say=print) -> dict:
  """Writes the round file `out` of the trajectories in `traces`; `say` gets each refused or
  left-out line. Returns what the file holds. UserError if no whole group is left."""
  from oapl_jax.models.transformer import ModelConfig  # noqa: PLC0415
  from oapl_jax.rl import offline, traces as traces_lib  # noqa: PLC0415
  from oapl_jax.tasks import make_task  # noqa: PLC0415
  _, tokenizer = make_task(config)
  if not getattr(tokenizer, "has_chat_template", False):
    raise errors.UserError(f"task.name={config.task.name!r}: its tokenizer has no chat template to "
                           "render the traces' messages with")
  try:
    lines = storage.read_bytes(traces).decode("utf-8").splitlines()
  except FileNotFoundError:
    raise errors.UserError(f"--traces={traces}: no such file") from None
  except UnicodeDecodeError as e:
    raise errors.UserError(f"--traces={traces}: not UTF-8 text ({e})") from None
  s = config.sampling
  imported = traces_lib.read_traces(lines, tokenizer, group_size=config.rl.group_size,
                                    max_prompt_len=s.max_prompt_len, max_new_tokens=s.max_new_tokens,
                                    thinking=getattr(config.task, "thinking", None))
  for line in imported.refused + imported.left_out:
    say(f"{traces}: {line}")
  if not imported.groups:
    raise errors.UserError(f"--traces={traces}: no whole group of rl.group_size={config.rl.group_size} "
                           f"trajectories of one prompt ({len(imported.refused)} lines refused)")
  model_meta = ModelConfig.from_config(config.model).architecture()
  header = {**offline.expected_header(config, model_meta), "round": 1, "seed": int(config.seed),
            "policy": {"version": 0, "snapshot_step": 0, "source": f"traces {traces}"},
            "logprobs": "sampler" if imported.has_logprobs else offline.NO_LOGPROBS,
            "problems": [{"prompt": p.prompt, "answer": p.answer, "id": p.id} for p in imported.problems]}
  arrays = traces_lib.round_arrays(imported)
  offline.write(out, header, arrays)
  model = int(arrays["answer_model"].sum())
  return {"out": out, "groups": imported.groups, "trajectories": len(imported.trajectories),
          "refused_lines": len(imported.refused), "prompts_with_trajectories_left_out": len(imported.left_out),
          "model_tokens": model, "environment_tokens": int(len(arrays["answer_model"]) - model),
          "logprobs": header["logprobs"]}


def main(argv):
  del argv
  config = config_lib.command_config(_CONFIG)
  check_output_file("out", _OUT.value)
  summary = import_traces(config, _TRACES.value, _OUT.value,
                          say=lambda line: print(line, file=sys.stderr))
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  errors.run_command(main)
