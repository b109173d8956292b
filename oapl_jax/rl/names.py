"""The names `config.rl` is checked against (the losses, the GRPO baseline's options) and OAPL's
beta2 rule.

JAX-free, so that `oapl_jax.config` validates without starting JAX; `rl/losses.py` registers a
loss under each of `LOSS_NAMES` (and checks, on import, that it registers exactly these).
"""

LOSS_NAMES = ("oapl", "grpo")  # rl.loss: OAPL's least squares | the GRPO+IS baseline
ADV_NORMS = ("std", "none")  # GRPO (divide by the group's std) | Dr.GRPO (no division)
IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask", "none")  # min(w, C) | drop outside [1/C, C] | w = 1
NORMS = ("token_mean", "seq_mean", "constant")
# rl.beta2_rule: beta2 as set | beta2 = beta1 | beta2 = rl.beta2_per_token / sampling.max_new_tokens
BETA2_RULES = ("fixed", "tied", "per_token")
# rl.grpo.prox, GRPO's pi_prox: the engine's snapshot (PPO anchored on the sampler's weights) |
# the trainer's weights as the step starts (asynchronous GRPO: TIS corrects sampler -> trainer)
GRPO_PROX = ("snapshot", "previous_step")


def oapl_beta2(rule: str, *, beta1: float, beta2: float, beta2_per_token: float,
               max_new_tokens: int) -> float:
  """OAPL's beta2 under `rule` (BETA2_RULES; docs/algorithm.md "Reachable targets").

  "fixed": `beta2`. "tied": `beta1`: each answer's target (R_i - V_hat) / beta1 is then the
  log-ratio log pi*/pi_old of the KL-optimal policy pi* = pi_old exp((R - V*) / beta1), a
  distribution, so every target is reachable by construction. "per_token": `beta2_per_token /
  max_new_tokens`, so the largest target, 1 / beta2 nats for rewards in [0, 1], is the same
  number of nats per token of the answer cap whatever the cap (16.384: the paper's 1e-3 at its
  16,384-token cap)."""
  if rule == "fixed":
    return float(beta2)
  if rule == "tied":
    return float(beta1)
  if rule == "per_token":
    return float(beta2_per_token) / int(max_new_tokens)
  raise ValueError(f"rl.beta2_rule must be one of {BETA2_RULES}, got {rule!r}")


def beta2_of(config) -> float:
  """OAPL's beta2 for a config: a ConfigDict, or a run's summary config (a dict; those of
  runs made before rl.beta2_rule existed have no rule: "fixed")."""
  rl = config["rl"]
  return oapl_beta2(rl.get("beta2_rule", "fixed"), beta1=rl["beta1"], beta2=rl["beta2"],
                    beta2_per_token=rl.get("beta2_per_token", 16.384),
                    max_new_tokens=config["sampling"]["max_new_tokens"])


def loss_line(config) -> str:
  """The loss and the settings it runs with, beta2 as its rule resolved it."""
  rl = config.rl
  if rl.loss == "oapl":
    return (f"loss oapl: beta1 {rl.beta1:g}, beta2 {beta2_of(config):.4g} (rl.beta2_rule="
            f"{rl.beta2_rule}), lag {rl.lag}")
  g = rl.grpo
  return (f"loss grpo: pi_prox {g.prox}, clip {g.eps_low:g}/{g.eps_high:g}, IS {g.is_level} "
          f"{g.is_mode} C={g.is_cap:g}, lag {rl.lag}")


def run_lines(config) -> list[str]:
  """What a run says of itself at start: its loss (`loss_line`) and, for multi-turn
  trajectories, its environment (docs/agents.md)."""
  lines = [loss_line(config)]
  e = config.env
  if e.name is not None:
    lines.append(f"environment {e.name}: up to {e.max_turns} model turns, {e.tool_timeout_s:g} s and "
                 f"{e.tool_output_chars} characters per tool call; env_* and tool_call_rate in metrics.jsonl")
  return lines
