"""Config: invalid values are refused naming the setting; overrides parse; typos fail; each
setting has one owner (the config), and reading a config needs neither JAX nor Flax."""

import inspect
import os
import subprocess
import sys

import ml_collections
import pytest

from configs import tiny
from oapl_jax import config as config_lib
from oapl_jax.config import ConfigError, validate

INF, NAN = float("inf"), float("nan")

# (setting, bad value) on configs/tiny.py: every numeric setting validate checks, each refused.
BAD = [
    # issue #11: these started work or hung
    ("train.lr", INF), ("rl.beta2", INF), ("sampling.temperature", INF), ("train.b1", 1.5),
    ("train.b2", -1.0), ("train.eps", -1.0), ("train.weight_decay", -1.0),
    ("seed", -1), ("seed", True),
    ("model.vocab_size", 0), ("model.hidden_size", 0), ("model.num_layers", 0),
    ("model.num_heads", 0), ("model.num_kv_heads", 0), ("model.num_kv_heads", 3),
    ("model.head_dim", 0), ("model.mlp_dim", -1), ("model.rope_theta", NAN),
    ("model.rms_norm_eps", 0.0), ("model.max_position_embeddings", 0),
    ("model.rope_scaling_type", "yarn"), ("model.dtype", "float8"), ("model.param_dtype", "int8"),
    ("warmup.steps", -1), ("warmup.noisy_steps", 2000), ("warmup.batch_size", 0),
    ("warmup.lr", NAN), ("warmup.lr", 0.0), ("warmup.digit_noise", 1.0), ("warmup.cached_only", True),
    ("sampling.temperature", 0.0), ("sampling.temperature", NAN), ("sampling.top_p", 1.5),
    ("sampling.top_p", NAN), ("sampling.top_k", -1), ("sampling.max_prompt_len", 0),
    ("sampling.max_new_tokens", 0), ("sampling.max_slots", 4), ("sampling.engines", 0),
    ("sampling.steps_per_call", 0), ("sampling.attn_chunk", 0), ("sampling.cache_bucket", 0),
    ("sampling.max_prefill_batch", 0), ("sampling.min_decode_width", 0),
    ("rl.loss", "ppo"), ("rl.beta1", 0.0), ("rl.beta1", NAN), ("rl.beta2", -1e-3),
    ("rl.group_size", 1), ("rl.lag", 0), ("rl.max_lag", 0), ("rl.old_logprobs", "trainer"),
    ("rl.groups_per_step", 0), ("rl.groups_per_rollout", 0), ("rl.mode", "replay"),
    ("rl.grpo.adv_eps", NAN), ("rl.grpo.adv_eps", -1.0), ("rl.grpo.eps_low", 1.0),
    ("rl.grpo.eps_high", INF), ("rl.grpo.is_cap", 0.5), ("rl.grpo.is_cap", INF),
    ("rl.grpo.kl_coef", INF), ("rl.grpo.kl_coef", -0.1),
    ("train.steps", 0), ("train.steps", True), ("train.lr", NAN), ("train.lr", 0.0),
    ("train.warmup_ratio", NAN), ("train.warmup_ratio", 1.0), ("train.min_lr_ratio", 1.5),
    ("train.b1", NAN), ("train.b2", 1.0), ("train.eps", 0.0), ("train.eps", INF),
    ("train.weight_decay", NAN), ("train.grad_clip", INF), ("train.grad_clip", 0.0),
    ("train.grad_accum", 0), ("train.grad_accum", 3), ("train.max_nonfinite_steps", 0),
    ("eval.samples_per_problem", 0), ("eval.every", -1),
    ("checkpoint.every", 0), ("checkpoint.keep", 0), ("log.every", 0),
    ("log.peak_flops", 0.0), ("log.peak_flops", INF), ("log.profile_steps", "3:2"),
    ("log.profile_steps", "0:2"), ("log.profile_steps", "2"), ("log.profile_steps", "a:b"),
    ("task.min_digits", 0), ("task.max_digits", 1), ("task.max_digits", 10), ("task.num_eval", 0),
]

# (config, setting, bad value): the task sections of the other configs.
TASK_BAD = [
    ("math.py:tiny", "task.num_eval", 0), ("math.py:tiny", "task.reward_workers", 0),
    ("code.py:tiny", "task.timeout_s", INF), ("code.py:tiny", "task.timeout_s", 0.0),
    ("code.py:tiny", "task.memory_mb", 0), ("code.py:tiny", "task.num_eval", 0),
    ("reasoning_gym.py:tiny", "task.size", 0), ("reasoning_gym.py:tiny", "task.num_eval", 0),
]


def _set(c, setting: str, value) -> None:
  *sections, field = setting.split(".")
  for name in sections:
    c = c[name]
  c[field] = value


def _refused(c, setting: str, value) -> None:
  _set(c, setting, value)
  with pytest.raises(ConfigError, match=r"config\." + setting.replace(".", r"\.") + "="):
    validate(c)


@pytest.mark.parametrize("setting,value", BAD)
def test_invalid_values_are_refused_by_name(setting, value):
  _refused(tiny.get_config(), setting, value)


def _tokenizer_folder(tmp_path) -> str:
  """A folder validate takes as a tokenizer's (it looks for the files, it does not load them)."""
  folder = tmp_path / "tokenizer"
  folder.mkdir()
  (folder / "tokenizer.json").write_text("{}")
  return str(folder)


@pytest.mark.parametrize("name,setting,value", TASK_BAD)
def test_invalid_task_values_are_refused_by_name(name, setting, value, tmp_path):
  c = config_lib.repo_config(name)
  c.model.path = None  # no checkpoint needed to validate: random init, a tokenizer folder
  c.task.tokenizer_path = _tokenizer_folder(tmp_path)
  validate(c)
  _refused(c, setting, value)


def test_wrong_types_are_refused_by_name():
  """A config built without ml_collections' type safety (a float step count, a str rate)."""
  for setting, value in (("train.steps", 2.5), ("train.lr", "1e-4"), ("rl.max_lag", 1.5)):
    c = ml_collections.ConfigDict(tiny.get_config().to_dict(), type_safe=False)
    _refused(c, setting, value)


def test_new_settings_have_their_defaults():
  c = tiny.get_config()
  assert c.train.max_nonfinite_steps == 3 and c.rl.max_lag is None
  c.rl.max_lag = 20  # >= rl.lag=10
  validate(c)


def test_default_and_smoke_configs_are_valid():
  validate(tiny.get_config())
  validate(tiny.get_config("smoke"))
  with pytest.raises(ValueError, match="unknown variant"):
    tiny.get_config("nope")


def _main(*args, workdir):
  return subprocess.run([sys.executable, "-m", "oapl_jax.main", *args, f"--workdir={workdir}"],
                        capture_output=True, text=True, timeout=300)


def test_bad_override_fails_before_any_work(tmp_path):
  out = _main("--config=configs/tiny.py", "--config.rl.lag=0", workdir=tmp_path / "w")
  assert out.returncode != 0
  assert "config.rl.lag=0" in out.stderr
  assert not (tmp_path / "w" / "checkpoints").exists()


def test_mistyped_override_fails(tmp_path):
  out = _main("--config=configs/tiny.py", "--config.rl.lagg=3", workdir=tmp_path / "w")
  assert out.returncode != 0
  assert "lagg" in out.stderr


def test_missing_config_file_fails_in_one_line(tmp_path):
  out = _main("--config=configs/nope.py", workdir=tmp_path / "w")
  assert out.returncode == 2, out.stderr
  assert out.stderr.strip().splitlines()[-1] == "error: --config=configs/nope.py: no such file"
  assert "Traceback" not in out.stderr


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", ["math.py:tiny", "code.py:tiny", "reasoning_gym.py:tiny",
                                  "gsm8k.py:tiny"])
def test_a_task_without_a_tokenizer_is_refused_by_name(name, tmp_path):
  """A task with a Hugging Face tokenizer reads it from task.tokenizer_path, else model.path: with
  neither (a random-init model) the run died in the tokenizer with a TypeError; a folder holding
  no tokenizer is named too. A memory plan (dry_run) reads no tokenizer."""
  c = config_lib.repo_config(name)
  c.model.path = None
  assert c.task.tokenizer_path is None
  validate(c, dry_run=True)
  with pytest.raises(ConfigError, match=r"^config\.task\.tokenizer_path=None: task '\w+' reads its "
                                        r"tokenizer .* both are None"):
    validate(c)
  c.task.tokenizer_path = str(tmp_path / "nope")
  with pytest.raises(ConfigError, match=r"^config\.task\.tokenizer_path='.*nope': tokenizer "
                                        r"folder '.*nope' does not exist"):
    validate(c)
  c.task.tokenizer_path = str(tmp_path)  # a folder, but no tokenizer files in it
  with pytest.raises(ConfigError, match=r"task\.tokenizer_path=.*no tokenizer files in"):
    validate(c)
  c.task.tokenizer_path = None
  c.model.path = str(tmp_path)
  (tmp_path / "config.json").write_text("{}")  # a checkpoint folder without a tokenizer
  with pytest.raises(ConfigError, match=r"^config\.model\.path=.*no tokenizer files in .* "
                                        r"\(the task's tokenizer: task\.tokenizer_path, else "
                                        r"model\.path\)$"):
    validate(c)
  c.task.tokenizer_path = _tokenizer_folder(tmp_path)
  validate(c)


def test_a_run_without_a_tokenizer_stops_in_one_line(tmp_path):
  config = tmp_path / "no_tokenizer.py"
  config.write_text("from configs import math\n\n\ndef get_config(arg=None):\n"
                    "  c = math.get_config('tiny')\n  c.model.path = None\n  return c\n")
  out = subprocess.run([sys.executable, "-m", "oapl_jax.main", f"--config={config}",
                        f"--workdir={tmp_path / 'w'}"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
  assert out.returncode == 2, out.stderr[-3000:]
  assert "Traceback" not in out.stderr
  assert out.stderr.strip().splitlines()[-1].startswith(
      "error: config.task.tokenizer_path=None: task 'math' reads its tokenizer"), out.stderr
  assert not (tmp_path / "w").exists()


def test_config_files_import_neither_jax_nor_flax():
  """A launcher or a notebook reads configs without JAX: checked in a fresh interpreter."""
  script = ("import sys; sys.path.insert(0, '.')\n"
            "import configs.tiny, configs.math, configs.code, configs.reasoning_gym\n"
            "from oapl_jax import config\n"
            "for name in ('tiny.py:smoke', 'math.py:tiny,lag=3', 'code.py:tiny', 'reasoning_gym.py'):\n"
            "  config.repo_config(name)\n"
            "print('jax' in sys.modules, 'flax' in sys.modules)\n")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["False", "False"]


def test_config_files_share_one_arg_parser():
  parse = config_lib.parse_arg
  assert parse("tiny,lag=100", tiny=bool, lag=int) == {"tiny": True, "lag": 100}
  assert parse(None, tiny=bool, dataset=str) == {"tiny": False, "dataset": None}
  assert parse("dataset=leg_counting", tiny=bool, dataset=str)["dataset"] == "leg_counting"
  for bad in ("huge", "tiny=1", "lag"):  # unknown, a flag given a value, a value without one
    with pytest.raises(ValueError, match=rf"unknown config arg '{bad}' \(unknown variant; "
                                         r"known: tiny, lag=N\)"):
      parse(f"tiny,{bad}", tiny=bool, lag=int)
  with pytest.raises(ValueError, match="config arg 'lag=x': lag must be int"):
    parse("lag=x", lag=int)
  assert config_lib.repo_config("math.py:lag=100,tiny").rl.lag == 100


def test_task_sections_share_their_settings():
  sections = {name: config_lib.task_section(name) for name in config_lib.TASKS}
  assert all(sections[name].name == name for name in config_lib.TASKS)
  assert "tokenizer_path" not in sections["addition"] and "tokenizer_path" in sections["math"]
  for name in config_lib.FILE_TASKS:
    assert sections[name].train_path is None and sections[name].skip_bad_rows is False
  with pytest.raises(ValueError, match="unknown task"):
    config_lib.task_section("chess")


# Keyword arguments of a loss that the trainer passes (not settings of the config).
TRAINER_ARGS = {"group_size", "num_answers", "num_tokens", "ref_logprobs"}


def test_loss_registry_names_each_loss_setting():
  """Every keyword argument of a registered loss but the trainer's comes from a config setting
  that exists; `kwargs_from_config` reads exactly those."""
  from oapl_jax.rl import losses  # noqa: PLC0415 (JAX)
  c = tiny.get_config()
  assert losses.LOSSES == {name: spec.fn for name, spec in losses.LOSS_SPECS.items()}
  for name, spec in losses.LOSS_SPECS.items():
    keyword = {p.name for p in inspect.signature(spec.fn).parameters.values()
               if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(spec.settings) == keyword - TRAINER_ARGS, name
    c.rl.loss = name
    assert losses.kwargs_from_config(c) == {
        arg: setting(c) if callable(setting) else config_lib._get(c, setting)
        for arg, setting in spec.settings.items()}
    for setting in spec.routing.values():  # what `apply` reads besides the loss's arguments
      config_lib._get(c, setting)
  c.rl.loss = "oapl"
  assert losses.kwargs_from_config(c) == {"beta1": 1.0, "beta2": 0.1}
  c.rl.loss = "grpo"
  assert losses.kwargs_from_config(c) == {
      "adv_norm": "std", "adv_eps": 1e-6, "eps_low": 0.2, "eps_high": 0.28, "is_level": "token",
      "is_mode": "truncate", "is_cap": 2.0, "norm": "token_mean", "kl_coef": 0.0, "max_tokens": 6}


def _required(fn, *names) -> bool:
  params = inspect.signature(fn).parameters
  return all(params[name].default is inspect.Parameter.empty for name in names)


def test_config_settings_have_no_second_default():
  """The engine, the code sandbox and the math reward's pool take the settings the config owns
  without defaults of their own, which could drift from it."""
  from oapl_jax.rewards import code, math  # noqa: PLC0415
  from oapl_jax.sampling.engine import CONFIG_SETTINGS, Engine  # noqa: PLC0415 (JAX)
  assert set(CONFIG_SETTINGS) <= set(tiny.get_config().sampling)
  assert _required(Engine, *CONFIG_SETTINGS)
  assert _required(code.score, "timeout_s", "memory_mb")
  assert _required(code.run_program, "timeout_s", "memory_mb")
  assert _required(math.score_batch, "workers")
