"""sampling.release_weights (sync mode): the engines let go of their weights after each rollout
and lay them out again for the next; the run is the same bit for bit, the planner holds the
engine copy for the sampling phase only, and the setting is refused where engines sample while
the trainer steps."""

import pytest

from configs import gsm8k, tiny
from oapl_jax import config as config_lib
from oapl_jax import plan, train
from oapl_jax.errors import ConfigError
from oapl_jax.metrics import read_metrics
from oapl_jax.sampling.parallel import Replicas

SAMPLED = ("loss", "entropy", "answer_length", "reward_mean", "trainer_vs_sampler_abs", "grad_norm",
           "policy_version", "samples_generated", "rollouts")


@pytest.mark.parametrize("arg, merge", [
    ("smoke", None),
    ("smoke,lora,int8", "in_refresh"),  # configs/gsm8k.py:qlora_4b's settings
    # the standing merged copy is let go too (CI: the two above, the plain model and in-refresh merge)
    pytest.param("smoke,lora", "kept", marks=pytest.mark.slow),
])
def test_released_weights_give_the_same_run_bit_for_bit(tmp_path, monkeypatch, arg, merge):
  """The smoke run (6 steps, pi_old refreshed every 3, on a base that earns rewards) with and
  without release_weights: every
  logged step's sampled figures and losses are equal, bit for bit; with it the engines lay the
  weights out once per rollout, without once per version (the evaluations alike). Broken by hand
  once (release without the layout counted: `Sampler.release` a no-op): the layout counts
  were equal and the test failed on them; and once with a released copy reused (version 0's
  weights sampled after the refresh): the logged steps differed."""
  layouts = []
  real = Replicas.load_params
  monkeypatch.setattr(Replicas, "load_params", lambda self, *a, **k: layouts.append(1) or real(self, *a, **k))
  rows, counts = {}, {}
  for release in (False, True):
    c = tiny.get_config(arg)
    if merge:
      c.model.lora.merge = merge
    c.sampling.release_weights = release
    c.seed, c.warmup.steps, c.warmup.noisy_steps = 3, 200, 50  # a base that earns rewards: the policy moves
    c.warmup.cache_dir = str(tmp_path / "cache")
    layouts.clear()
    train.run(c, str(tmp_path / f"run{release}"))
    counts[release] = len(layouts)
    rows[release] = [{k: r[k] for k in SAMPLED if k in r} for r in read_metrics(str(tmp_path / f"run{release}"))]
  assert len(rows[True]) == 6 and rows[True] == rows[False]
  assert any(r["reward_mean"] > 0 for r in rows[True]), rows[True]  # advantages: pi_theta moved
  rollouts, versions = rows[True][-1]["rollouts"], rows[True][-1]["policy_version"] + 1
  assert rollouts > versions  # more layouts with the release: one per rollout, not per version
  assert counts[True] - counts[False] == rollouts - versions, (counts, rollouts, versions)


def test_release_weights_is_refused_where_engines_sample_beside_the_trainer():
  c = tiny.get_config()
  c.rl.mode, c.sampling.release_weights = "async", True
  with pytest.raises(ConfigError) as e:
    config_lib.validate(c)
  assert str(e.value) == ("config.sampling.release_weights=True: needs rl.mode 'sync' (in rl.mode "
                          "'async' the engines sample while the trainer steps)")


def test_qlora_4b_fits_a_t4_and_a_v5e_1_with_the_engine_copy_held_while_sampling_only():
  """configs/gsm8k.py:qlora_4b (an int8 base, no standing merged copy, released engine weights):
  Qwen3-4B fits a 16 GB T4 and a v5e-1 in the plan; without the release it does not."""
  for topology in ("t4x1", "v5e-1"):
    c = gsm8k.get_config("qlora_4b")
    c.mesh.topology = topology
    p = plan.make_plan(c)
    items = {i.name: i for i in p.items}
    assert items["engine snapshot"].phase == "step" and items["frozen base"].phase == "state"
    assert p.fits and p.headroom > 2**30, p.format()
    c.sampling.release_weights = False
    assert not plan.make_plan(c).fits
